//! `kvshard plan` prints the seed's scenario (CP2 on 4 GPUs: two prefill ranks, two decodes,
//! 16,384 logical GPU slots, a host cache 4x larger) with the figures the library computes, and
//! those agree with the figures worked out by hand from the byte layouts; impossible inputs are
//! refused in one line.

mod common;

use std::process::Command;

use common::kvshard_bin;
use kvshard::geometry::{LatentLayout, Model};
use kvshard::pool::capacity::{
    CapacityPlan, CapacityRequest, Ceilings, HostCapacity, Tier, DEFAULT_DIO_ALIGN,
};
use kvshard::pool::BudgetRequest;

/// The seed's scenario as `kvshard plan` flags: the GPU memory that leaves exactly 128 pages per
/// rank after the scratch of one 12,288-token context and a 2,048-token chunk.
const SEED: &[&str] = &[
    "plan",
    "--model",
    "deepseek-v32",
    "--cp",
    "2",
    "--gpu-mem",
    "400376832",
    "--host-mem",
    "4x",
    "--disk",
    "10GB",
    "--context-len",
    "12288",
    "--chunk",
    "2048",
    "--contexts",
    "1",
    "--prefixes",
    "4096,16384",
    "--d2d-gbps",
    "2000",
    "--h2d-gbps",
    "50",
    "--disk-gbps",
    "5",
];

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(kvshard_bin())
        .args(args)
        .output()
        .expect("run kvshard");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The cells of the table row starting with `| first`.
fn row<'a>(text: &'a str, first: &str) -> Vec<&'a str> {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("| {first} ")))
        .unwrap_or_else(|| panic!("no row {first:?} in\n{text}"));
    line.trim_matches('|').split('|').map(str::trim).collect()
}

/// The number after `label` on its line.
fn figure(text: &str, label: &str) -> u64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in\n{text}"));
    let rest = &text[at + label.len()..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().unwrap()
}

#[test]
fn the_seed_scenario_prints_what_the_library_and_the_hand_compute() {
    let (ok, text) = run(SEED);
    assert!(ok, "{text}");

    // By hand: 61 target layers + the draft, each a 36,864-byte latent block and an 8,448-byte
    // indexer block per page; a slot rounds that up to 4 KiB.
    let page: u64 = 62 * (64 * 576 + 8448);
    assert_eq!(page, 2_809_344);
    let slot = page.div_ceil(4096) * 4096;
    // Scratch: 12,288 prefix rows (a multiple of 2 x 64) + 2,048 chunk rows + 64 trash rows,
    // two slots (layer parity) of 576 + 132 bytes a row, twice with the draft.
    let scratch = (12_288 + 2048 + 64) * 2 * (576 + 132) * 2;
    assert_eq!(scratch, 40_780_800);
    let gpu_pages = (400_376_832 - scratch) / page;
    assert_eq!(gpu_pages, 128);
    let slots = 10_000_000_000 / slot;

    // The library's plan of the same request.
    let mut gpu = BudgetRequest::new(400_376_832, 12_288, 2048);
    gpu.contexts = 1;
    let plan = CapacityPlan::plan(&CapacityRequest {
        geometry: Model::DeepseekV32.geometry(LatentLayout::Fp8Trtllm, true),
        cp: 2,
        gpu,
        host: HostCapacity::Factor(4),
        disk_bytes: 10_000_000_000,
        dio_align: DEFAULT_DIO_ALIGN,
        ceilings: Ceilings {
            d2d_gbps: Some(2000.0),
            h2d_gbps: Some(50.0),
            disk_gbps: Some(5.0),
        },
        prefixes: vec![4096, 16_384],
    })
    .unwrap();
    assert_eq!(plan.budget.scratch_bytes, scratch);
    assert_eq!(plan.budget.logical_capacity, 16_384);

    assert_eq!(figure(&text, "page:"), page);
    assert_eq!(figure(&text, "L3 slot:"), slot);
    assert_eq!(figure(&text, "scratch budget per rank:"), scratch);
    assert_eq!(figure(&text, "logical GPU slots:"), 16_384);
    assert_eq!(figure(&text, "host pages per rank:"), 4 * gpu_pages);
    assert_eq!(figure(&text, "L3 slots:"), slots);

    // The tiers: pages per rank, pages of the group, tokens without each rank's padding page.
    for (tier, per_rank, pages, tokens) in [
        ("GPU (L1)", Some(128), 256, 127 * 2 * 64),
        ("host (L2)", Some(512), 1024, 511 * 2 * 64),
        ("disk (L3)", None, slots, slots * 64),
    ] {
        let cells = row(&text, tier);
        let lib = plan
            .tiers
            .iter()
            .find(|t| t.tier.to_string() == tier)
            .unwrap();
        assert_eq!(lib.pages_per_rank, per_rank, "{tier}");
        assert_eq!((lib.pages, lib.tokens), (pages, tokens), "{tier}");
        let shown = per_rank.map_or("shared".to_string(), |p: u64| p.to_string());
        assert_eq!(cells[2], shown, "{tier}");
        assert_eq!(cells[3], pages.to_string(), "{tier}");
        assert_eq!(cells[4], tokens.to_string(), "{tier}");
    }
    assert_eq!(plan.tier(Tier::Host).unwrap().bytes, 512 * page);

    // The seed's 4,096-token prefix: 64 pages, 32 on each rank.
    let cells = row(&text, "4096 tokens");
    assert_eq!(cells[1], "64 (32)");
    let ms = |bytes: u64, gbps: f64| format!("{:.3} ms", bytes as f64 / (gbps * 1e9) * 1e3);
    let from_host = ms(32 * page, 50.0);
    assert_eq!(cells[2], ms(32 * page, 2000.0));
    assert_eq!(cells[3], from_host);
    let from_disk = 64.0 * slot as f64 / 5e9 + (32 * page) as f64 / 50e9;
    assert_eq!(cells[4], format!("{:.3} ms", from_disk * 1e3));
    let lib = &plan.reloads[0].tiers;
    assert_eq!(cells[3], format!("{:.3} ms", lib[1].seconds.unwrap() * 1e3));
    // 16K tokens are every logical GPU slot, padding included: they do not fit the GPU.
    let cells = row(&text, "16384 tokens");
    assert_eq!(cells[1..3], ["256 (128)", "does not fit"]);
    assert!(!plan.reloads[1].tiers[0].fits);
}

#[test]
fn impossible_plans_are_refused_in_one_line() {
    let with = |flag: &str, value: &str| {
        let mut args: Vec<&str> = SEED.to_vec();
        match args.iter().position(|a| *a == flag) {
            Some(at) => args[at + 1] = value,
            None => args.extend([flag, value]),
        }
        let (ok, text) = run(&args);
        assert!(!ok, "{flag} {value}: {text}");
        assert_eq!(text.trim_end().lines().count(), 1, "{text}");
        text
    };
    assert!(with("--cp", "0").contains("0 ranks"));
    assert!(with("--gpu-mem", "40MB").contains("GPU memory per rank"));
    assert!(with("--host-mem", "2MB").contains("host memory per rank holds 0 pages"));
    assert!(with("--disk", "1MB").contains("holds no slot"));
    assert!(with("--h2d-gbps", "0").contains("pinned H2D ceiling"));
    assert!(with("--dio-align", "1000").contains("power of two"));
    assert!(with("--gpu-mem", "40 parsecs").contains("unit"));
    // Old behaviour: a 0-token context and a 0-token chunk were planned.
    assert!(with("--context-len", "0").contains("context length of 0 tokens"));
    assert!(with("--chunk", "0").contains("chunk size of 0 tokens"));
    assert!(with("--contexts", "0").contains("contexts per batch of 0"));
    let (ok, text) = run(&[SEED, &["--disk-path", "."]].concat());
    assert!(
        !ok && text.contains("--disk-path does nothing without --measure"),
        "{text}"
    );
    let no_disk_ceiling: Vec<&str> = SEED[..SEED.len() - 2].to_vec();
    let (ok, text) = run(&[&no_disk_ceiling[..], &["--measure"]].concat());
    assert!(
        !ok && text.contains("--measure reads the disk in --disk-path"),
        "{text}"
    );
}

#[test]
fn measuring_reads_the_disk_directly_and_leaves_no_probe() {
    // The build's scratch directory (on the disk); where the test binary runs elsewhere (staged
    // on a GPU host), the system's temporary directory.
    let name = format!("plan-measure-{}", std::process::id());
    let dir = [
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
        std::env::temp_dir(),
    ]
    .into_iter()
    .map(|d| d.join(&name))
    .find(|d| std::fs::create_dir_all(d).is_ok())
    .expect("a directory to measure in");
    let path = dir.to_str().unwrap();
    let no_ceilings: Vec<&str> = SEED[..SEED.len() - 6].to_vec();
    let (ok, text) = run(&[&no_ceilings[..], &["--measure", "--disk-path", path]].concat());
    if ok {
        // Every ceiling is measured, so every reload that fits has a time.
        assert!(
            text.contains("disk ") && text.contains("measured: O_DIRECT reads"),
            "{text}"
        );
        assert!(!text.contains("n/a"), "{text}");
    } else {
        // A filesystem without O_DIRECT says so and what to do instead.
        assert!(
            text.contains("O_DIRECT") && text.contains("--disk-gbps"),
            "{text}"
        );
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "a probe was left in {path}"
    );
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn reloads_by_another_parallelism_show_each_readers_busiest_rank() {
    let (ok, text) = run(SEED);
    assert!(ok, "{text}");
    // By hand, as above: a page, a slot.
    let page: u64 = 62 * (64 * 576 + 8448);
    let slot = page.div_ceil(4096) * 4096;
    let ms = |seconds: f64| format!("{:.3} ms", seconds * 1e3);
    // The seed's 4,096-token prefix (64 pages) cached by CP2: the busiest reader rank reads
    // 64 / N' pages in a CP group, 64 / M in a DCP group (its own pages at I = 64, each page
    // once round-robin at I = 1).
    for (reader, busiest) in [
        ("unsharded", 64u64),
        ("CP2", 32),
        ("CP4", 16),
        ("CP8", 8),
        ("DCP2 I=1", 32),
        ("DCP2 I=64", 32),
        ("DCP4 I=1", 16),
        ("DCP4 I=64", 16),
        ("DCP8 I=1", 8),
        ("DCP8 I=64", 8),
    ] {
        let cells = row(&text, &format!("4096 tokens, {reader}"));
        let host = (busiest * page) as f64 / 50e9;
        // From L3: the group reads each of the 64 slots once from the shared disk.
        let disk = (64 * slot) as f64 / 5e9 + host;
        assert_eq!(
            cells[1..],
            [busiest.to_string(), ms(host), ms(disk)],
            "{reader}"
        );
    }
    // CP2 reading what CP2 wrote takes what the writer group's reload table says.
    assert_eq!(
        row(&text, "4096 tokens, CP2")[2..],
        row(&text, "4096 tokens")[3..5]
    );
    // 16K tokens (256 pages): CP4 reads 64 pages a rank.
    let cells = row(&text, "16384 tokens, CP4");
    assert_eq!(cells[1], "64");
    // Without a disk ceiling, the L3 column says so.
    let no_disk: Vec<&str> = SEED[..SEED.len() - 2].to_vec();
    let (ok, text) = run(&no_disk);
    assert!(ok, "{text}");
    assert_eq!(row(&text, "4096 tokens, DCP4 I=1")[3], "n/a (no ceiling)");
}
