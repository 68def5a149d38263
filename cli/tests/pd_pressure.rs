//! `kvshard pd --scenario pressure`: the seed's topology with every CP rank and every decode a
//! process of its own, on the CPU twin (CI) and on one GPU (`gpu_*`, SKIPPED without one).
//!
//! - the run ends with every decode pool byte-identical to the unsharded reference, for CP2
//!   with two decodes (the seed's shape), CP4 with one decode and an unsharded prefill with
//!   three;
//! - with the decodes as decode context-parallel groups (a process per decode rank), CP2 into
//!   DCP2 at I = 1 and DCP4 at I = 64: every decode rank's rows byte-identical to the unsharded
//!   reference re-laid out;
//! - the storage step across processes (feature `nixl`): each rank writes its own pages to a
//!   shared directory and reloads the prefix from it, checked against the reference; then the
//!   prefix as the CP2 ranks left it is reloaded into CP4 (two reader ranks per process);
//! - a rank killed in the middle makes every other process fail with an error and exit (none
//!   hangs), and the run says which process failed;
//! - the CP group memory's barrier, slots and NCCL id across threads, and its refusals.
//!
//! The processes are the `kvshard` binary (`KVSHARD_BIN` names another, as the GPU staging
//! does).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::kvshard_bin;
use kvshard::ipc::group::{group_bytes, GroupMemory, NCCL_ID_BYTES};
use kvshard::Error;
use kvshard_cli::pd::pressure::PressurePdConfig;
use kvshard_cli::scenario::Platform;

/// Runs the scenario with `args` and returns its report table; panics with its output if it
/// failed.
fn run_pressure(args: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!("kvshard-pressure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let markdown = dir.join(format!("{}.md", args.join("_").replace(['-', ' '], "")));
    let out = Command::new(kvshard_bin())
        .args(["pd", "--scenario", "pressure"])
        .args(args)
        .arg("--markdown")
        .arg(&markdown)
        .output()
        .expect("run kvshard");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(&markdown).unwrap()
}

/// Checks the report: every (prompt, decode) row says byte-identical, and every rank reported
/// its sends and its reload.
fn assert_verified(table: &str, ranks: usize, decodes: usize) {
    let verified = table
        .lines()
        .filter(|l| l.ends_with("| byte-identical |"))
        .count();
    assert_eq!(verified, 2 * decodes, "{table}");
    assert!(!table.contains("| NO |"), "{table}");
    let rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.contains("prefix reload H2D bytes"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    let reloads = rows.iter().filter(|l| !l.starts_with("| all")).count();
    assert_eq!(reloads, ranks, "{table}");
    // Ranks that share a host link (the CPU twin's, or one GPU's) get a row for their reloads
    // together; ranks on GPUs of their own do not.
    let shared = rows
        .iter()
        .filter(|l| l.contains("one shared link"))
        .count();
    if table.contains("CPU twin") {
        assert_eq!(shared, usize::from(ranks > 1), "{table}");
    } else {
        assert!(shared <= 1, "{table}");
    }
}

/// Checks the storage step across processes where it must run (the `nixl` feature, and the
/// runtime required by KVSHARD_REQUIRE_NIXL): every rank wrote its own pages to the shared
/// directory, found the whole prefix from its own replay of the others' journals (every rank's
/// snapshot covering the same records), reloaded L3 -> L2 -> L1 byte-identical to the
/// reference, and reloaded its reader ranks (r and r + N) of a CP group of 2N from the
/// directory byte-identical to the reference, the readers of all ranks reading every page once.
/// Elsewhere every rank says why it did not run.
fn assert_storage(table: &str, ranks: u32) {
    let rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.contains("storage step"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    if !(cfg!(feature = "nixl") && std::env::var_os("KVSHARD_REQUIRE_NIXL").is_some()) {
        assert!(rows.len() >= ranks as usize, "{table}");
        return;
    }
    let mut snapshots = Vec::new();
    let mut read = Vec::new();
    for r in 0..ranks {
        let mine: Vec<&&str> = rows
            .iter()
            .filter(|l| l.starts_with(&format!("| {r} |")))
            .collect();
        assert!(
            mine.iter()
                .any(|l| l.contains("byte-identical to the unsharded reference")),
            "rank {r}: {table}"
        );
        let found = mine
            .iter()
            .find(|l| l.contains("records per writer"))
            .unwrap_or_else(|| panic!("rank {r}: {table}"));
        assert!(found.contains("finds all"), "{table}");
        let records = found.split('[').nth(1).and_then(|x| x.split(']').next());
        snapshots.push(records.map(str::to_string));
        // The prefix as the writers left it, reloaded into a CP group of twice the size: this
        // process hosts reader ranks r and r + N.
        let wider = mine
            .iter()
            .find(|l| {
                l.contains(&format!(
                    "the CP{ranks}-written prefix reloaded into CP{} (disk -> host -> device, reader ranks [{r}, {}] here, ",
                    2 * ranks,
                    r + ranks
                ))
            })
            .unwrap_or_else(|| panic!("rank {r}: {table}"));
        assert!(
            wider.contains("): byte-identical to the unsharded reference ("),
            "{table}"
        );
        let counts: Vec<u64> = wider
            .split(" here, ")
            .nth(1)
            .and_then(|x| x.split(" pages,").next())
            .map(|x| x.split(" of its ").map(|n| n.parse().unwrap()).collect())
            .unwrap_or_else(|| panic!("{table}"));
        read.push((counts[0], counts[1]));
    }
    assert!(
        snapshots.iter().all(|s| s.is_some() && *s == snapshots[0]),
        "every rank's snapshot covers the same records: {table}"
    );
    // Between them the readers read every page of the prefix once.
    let total = read[0].1;
    assert!(
        total > 0 && read.iter().all(|&(_, t)| t == total),
        "{table}"
    );
    assert_eq!(
        read.iter().map(|&(here, _)| here).sum::<u64>(),
        total,
        "{table}"
    );
}

#[test]
fn cpu_cp2_with_two_decodes_is_byte_identical_to_the_unsharded_reference() {
    let table = run_pressure(&["--cpu"]);
    assert_verified(&table, 2, 2);
    assert!(table.contains("all-gather: host shared memory"), "{table}");
    assert_storage(&table, 2);
    // NCCL where it cannot run is refused up front, not tried.
    let out = Command::new(kvshard_bin())
        .args([
            "pd",
            "--scenario",
            "pressure",
            "--cpu",
            "--all-gather",
            "nccl",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("NCCL needs GPUs"));
}

#[test]
fn cpu_cp4_with_one_decode_and_an_unsharded_prefill_with_three_are_byte_identical() {
    assert_verified(
        &run_pressure(&["--cpu", "--ranks", "4", "--decodes", "1"]),
        4,
        1,
    );
    assert_verified(
        &run_pressure(&["--cpu", "--ranks", "1", "--decodes", "3"]),
        1,
        3,
    );
}

/// Checks a run into decode context-parallel groups of `m` ranks: every decode rank of every
/// group reports both prompts, its rows (`rows` each) and its bytes, byte-identical to the
/// unsharded reference re-laid out, and the bytes a prompt's decode ranks received add up to
/// what the prefill ranks sent.
fn assert_dcp_verified(table: &str, groups: usize, m: usize, rows: u64) {
    assert!(table.contains(&format!("DCP{m} groups")), "{table}");
    let landed: Vec<Vec<&str>> = table
        .lines()
        .skip_while(|l| !l.contains("| DCP rank | rows |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    assert_eq!(landed.len(), 2 * groups * m, "{table}");
    for prompt in ["1", "2"] {
        let of: Vec<&Vec<&str>> = landed.iter().filter(|c| c[1] == prompt).collect();
        let mut ranks: Vec<(&str, &str)> = of.iter().map(|c| (c[2], c[3])).collect();
        ranks.sort_unstable();
        ranks.dedup();
        assert_eq!(ranks.len(), groups * m, "every decode rank once: {table}");
        for c in &of {
            assert_eq!(c[4].parse::<u64>().unwrap(), rows, "{table}");
            assert!(c[5].parse::<u64>().unwrap() > 0, "{table}");
            assert_eq!(c[7], "byte-identical", "{table}");
        }
        let received: u64 = of.iter().map(|c| c[5].parse::<u64>().unwrap()).sum();
        let sent = table
            .lines()
            .find(|l| l.starts_with(&format!("| {prompt} | all, concurrent")))
            .and_then(|l| l.split('|').nth(3))
            .map(|b| b.trim().parse::<u64>().unwrap())
            .unwrap_or_else(|| panic!("{table}"));
        assert_eq!(received, sent, "{table}");
    }
}

#[test]
fn cpu_cp2_into_dcp2_and_dcp4_decode_groups_is_byte_identical_to_the_reference_re_laid_out() {
    // Every decode rank a process: CP2 into one DCP2 group at I = 1 (every other row of a
    // page), then into one DCP4 group at I = 64 (whole pages, round-robin). The CPU shape's
    // prompts are 12,288 tokens: 6,144 and 3,072 rows a decode rank.
    for (m, i, rows) in [("2", "1", 6144), ("4", "64", 3072)] {
        let table = run_pressure(&[
            "--cpu",
            "--decodes",
            "1",
            "--decode-dcp",
            m,
            "--decode-interleave",
            i,
        ]);
        assert_dcp_verified(&table, 1, m.parse().unwrap(), rows);
        assert!(table.contains(&format!("(I = {i}")), "{table}");
    }
}

#[test]
fn gpu_cp2_into_dcp2_and_dcp4_decode_groups_is_byte_identical_to_the_reference_re_laid_out() {
    if common::open_gpu(
        "gpu_cp2_into_dcp2_and_dcp4_decode_groups_is_byte_identical_to_the_reference_re_laid_out",
    )
    .is_none()
    {
        return;
    }
    // The same on the GPUs there are (the rows kernel at I = 1, the pages kernel at I = 64, into
    // pools of other processes mapped here); 4 layers keep it quick.
    for (m, i, rows) in [("2", "1", 6144), ("4", "64", 3072)] {
        let table = run_pressure(&[
            "--layers",
            "4",
            "--decodes",
            "1",
            "--decode-dcp",
            m,
            "--decode-interleave",
            i,
        ]);
        assert_dcp_verified(&table, 1, m.parse().unwrap(), rows);
    }
}

#[test]
fn gpu_cp2_with_two_decodes_is_byte_identical_to_the_unsharded_reference() {
    if common::open_gpu("gpu_cp2_with_two_decodes_is_byte_identical_to_the_unsharded_reference")
        .is_none()
    {
        return;
    }
    // Every process on the GPUs there are; 4 layers keep it quick, under the sanitizers too
    // (the figures come from the full shape: `run-gpu.sh pressure`, BENCHMARKS.md).
    let table = run_pressure(&["--layers", "4"]);
    assert_verified(&table, 2, 2);
}

#[test]
fn cpu_a_killed_rank_fails_every_other_process_which_all_exit() {
    // Early (the other rank is sending prompt 1), and once prompt 1 is sent (the other rank
    // soon waits for it at the CP group's barrier before prompt 2's first gather).
    for (k, line) in ["seed:", "prompt 1:"].iter().enumerate() {
        killed_rank(k, line);
    }
}

/// Runs the scenario's processes and kills rank 1 once it has printed a line starting `after`.
fn killed_rank(k: usize, after: &str) {
    // The ranks refuse a group of another shape: its slots are the scenario's send buffers.
    let cfg = PressurePdConfig::default_for(Platform::Cpu);
    let group = GroupMemory::create(2, cfg.slot_bytes().unwrap()).unwrap();
    let socket =
        std::env::temp_dir().join(format!("kvshard-pressure-kill-{}-{k}", std::process::id()));
    let common_args = |role: &str, index: u32| {
        let mut args: Vec<String> = ["pd", "--scenario", "pressure", "--cpu", "--socket"]
            .map(String::from)
            .to_vec();
        args.push(socket.display().to_string());
        args.extend(["--group".into(), group.proc_path().display().to_string()]);
        args.extend([
            "--role".into(),
            role.into(),
            "--rank".into(),
            index.to_string(),
        ]);
        args
    };
    let spawn = |role: &str, index: u32| {
        Command::new(kvshard_bin())
            .args(common_args(role, index))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut decodes = [spawn("decode", 0), spawn("decode", 1)];
    let mut rank0 = spawn("prefill", 0);
    let mut rank1 = spawn("prefill", 1);
    // Kill rank 1 once it is where `after` says.
    let lines = BufReader::new(rank1.stdout.take().unwrap());
    for line in lines.lines().map_while(Result::ok) {
        if line.starts_with(after) {
            break;
        }
    }
    rank1.kill().unwrap();
    rank1.wait().unwrap();
    let start = Instant::now();
    // Well inside every timeout of the run (the group's waits, the channels' liveness).
    let deadline = Duration::from_secs(10);
    for (name, child) in decodes
        .iter_mut()
        .map(|c| ("decode", c))
        .chain([("rank 0", &mut rank0)])
    {
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > deadline {
                let _ = child.kill();
                panic!("{name} still runs {deadline:?} after rank 1 was killed");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(!status.success(), "{name} succeeded without rank 1");
    }
    let mut said = String::new();
    for p in decodes.iter_mut().chain([&mut rank0]) {
        std::io::Read::read_to_string(p.stderr.as_mut().unwrap(), &mut said).unwrap();
        std::io::Read::read_to_string(p.stdout.as_mut().unwrap(), &mut said).unwrap();
    }
    assert!(
        said.contains("rank 1"),
        "killed after {after:?}: the others name the gone rank:\n{said}"
    );
    for d in 0..2 {
        let _ = std::fs::remove_file(format!("{}.{d}", socket.display()));
    }
}

// ---------------------------------------------------------------------------------------------
// The CP group memory.

#[test]
fn group_memory_barriers_exchange_slots_and_hand_out_the_nccl_id() {
    let ranks = 3u32;
    let slot = 4096 + 13;
    let shm = GroupMemory::create(ranks, slot).unwrap();
    let path = shm.proc_path();
    let threads: Vec<_> = (0..ranks)
        .map(|rank| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut g =
                    GroupMemory::join(&path, rank, ranks, slot, Duration::from_secs(20)).unwrap();
                if rank == 0 {
                    g.publish_nccl_id(&[7; NCCL_ID_BYTES]).unwrap();
                }
                assert_eq!(g.nccl_id_sync().unwrap(), [7; NCCL_ID_BYTES]);
                for round in 0..20u8 {
                    let mine = vec![round ^ rank as u8; slot];
                    g.write_slot(&mine).unwrap();
                    g.barrier_sync().unwrap();
                    for other in 0..ranks {
                        let mut got = vec![0; slot];
                        g.read_slot(other, &mut got).unwrap();
                        assert!(
                            got.iter().all(|&b| b == round ^ other as u8),
                            "round {round}"
                        );
                    }
                    g.barrier_sync().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn group_memory_refuses_other_shapes_and_out_of_range_slots_and_times_out_alone() {
    let shm = GroupMemory::create(2, 100).unwrap();
    let path = shm.proc_path();
    let t = Duration::from_millis(200);
    for (rank, ranks, slot) in [(0, 3, 100), (0, 2, 101), (2, 2, 100)] {
        let e = GroupMemory::join(&path, rank, ranks, slot, t).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    let mut g = GroupMemory::join(&path, 1, 2, 100, t).unwrap();
    assert!(g.write_slot(&[0; 101]).is_err());
    assert!(g.read_slot(2, &mut [0; 10]).is_err());
    assert!(matches!(
        g.publish_nccl_id(&[0; NCCL_ID_BYTES]),
        Err(Error::InvalidArgument(_))
    ));
    // Rank 0 never comes: the barrier and the id give up instead of hanging.
    assert!(matches!(g.barrier_sync(), Err(Error::Timeout { .. })));
    assert!(matches!(g.nccl_id_sync(), Err(Error::Timeout { .. })));
    assert!(matches!(
        GroupMemory::create(0, 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        group_bytes(2, usize::MAX),
        Err(Error::Overflow { .. })
    ));
    // A plain file of the right size is no group: it is not sealed, and whoever holds it could
    // truncate it under the mapping.
    let plain = std::env::temp_dir().join(format!("kvshard-group-{}", std::process::id()));
    std::fs::write(&plain, vec![0u8; group_bytes(2, 100).unwrap()]).unwrap();
    let e = GroupMemory::join(&plain, 0, 2, 100, t).unwrap_err();
    std::fs::remove_file(&plain).unwrap();
    assert!(e.to_string().contains("sealed"), "{e}");
}
