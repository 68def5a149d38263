//! The command line refuses every run that cannot go before anything starts: launch shapes the
//! copy kernel does not take, more processes than the machine takes, flags the chosen scenario
//! would ignore, role flags out of range, shapes out of bounds, and a `--markdown` report that
//! cannot be written. `parse` allocates nothing and starts nothing; the binary's refusals are one
//! line, exit status 1, and come before the line a run prints as it starts its processes.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::kvshard_bin;
use kvshard_cli::cli::{parse, PROCESSES_PER_CPU};

/// The one-line refusal of `args` (after `kvshard`), which must be refused.
fn refusal(args: &[&str]) -> String {
    let argv = std::iter::once("kvshard").chain(args.iter().copied());
    match parse(argv) {
        Ok(_) => panic!("{args:?} was accepted"),
        Err((line, code)) => {
            assert_eq!(code, 1, "{args:?}: {line}");
            assert!(!line.trim_end().contains('\n'), "{args:?}: {line}");
            line
        }
    }
}

/// Asserts `args` are refused with a line containing `why`.
fn refused(args: &[&str], why: &str) {
    let line = refusal(args);
    assert!(
        line.contains(why),
        "{args:?}: {line:?} does not say {why:?}"
    );
}

#[test]
fn launch_shapes_the_copy_kernel_does_not_take_are_refused() {
    let shape = "need 1 to 2147483647 CTAs, a multiple of 32 threads, at most 1024";
    for args in [
        &["pd", "--cpu", "--ctas", "0"][..],
        // Past CUDA's largest grid (accepted before, and refused only by the driver).
        &["pd", "--cpu", "--ctas", "4294967295"],
        &["pd", "--cpu", "--methods", "blocks:2147483648"],
        &["pd", "--cpu", "--ctas", "8,0"],
        &["pd", "--cpu", "--threads", "4096"],
        &["pd", "--cpu", "--threads", "100"],
        &["pd", "--cpu", "--threads", "0"],
        &["pd", "--cpu", "--methods", "blocks:0"],
        &["pd", "--cpu", "--methods", "ce,blocks:8:2048"],
        &["pd", "--cpu", "--scenario", "pressure", "--ctas", "0"],
        &["pd", "--cpu", "--scenario", "pressure", "--threads", "4096"],
        &[
            "pd",
            "--cpu",
            "--scenario",
            "pressure",
            "--methods",
            "blocks:0",
        ],
    ] {
        refused(args, shape);
    }
    refused(
        &["pd", "--cpu", "--methods", "blocks:x"],
        "expected blocks:CTAS",
    );
    refused(&["pd", "--cpu", "--methods", "dma"], "expected blocks:CTAS");
    // What the copy kernel takes is accepted.
    for args in [
        &["kvshard", "pd", "--cpu", "--ctas", "1", "--threads", "1024"][..],
        &["kvshard", "pd", "--cpu", "--methods", "blocks:3:32,ce"],
    ] {
        assert!(parse(args.iter().copied()).is_ok(), "{args:?}");
    }
}

#[test]
fn more_processes_than_the_machine_takes_are_refused() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = PROCESSES_PER_CPU * cpus;
    let line = refusal(&["pd", "--cpu", "--ranks", "4096"]);
    assert!(
        line.contains("would start 4097 processes")
            && line.contains(&format!("at most {most}"))
            && line.contains("lower --ranks or --decodes"),
        "{line}"
    );
    // One more than the machine takes, in either scenario.
    let ranks = (most as u32).to_string();
    refused(&["pd", "--cpu", "--ranks", &ranks], "processes");
    // (The pressure scenario's shape bounds its ranks first: CP8 and eight decodes.)
    if most < 16 {
        refused(
            &[
                "pd",
                "--cpu",
                "--scenario",
                "pressure",
                "--ranks",
                "8",
                "--decodes",
                "8",
            ],
            "would start 16 processes",
        );
    }
    refused(
        &["pd", "--cpu", "--scenario", "pressure", "--decodes", "9"],
        "9 decodes (1 to 8)",
    );
    refused(
        &["pd", "--cpu", "--scenario", "pressure", "--decodes", "0"],
        "0 decodes",
    );
}

#[test]
fn flags_the_scenario_would_ignore_are_refused() {
    for (args, flag) in [
        (&["pd", "--cpu", "--decodes", "2"][..], "--decodes"),
        (&["pd", "--cpu", "--all-gather", "host"], "--all-gather"),
        (&["pd", "--cpu", "--methods", "ce", "--ctas", "4"], "--ctas"),
        (
            &["pd", "--cpu", "--methods", "naive", "--threads", "64"],
            "--threads",
        ),
        (
            &["pd", "--cpu", "--scenario", "pressure", "--pages", "4"],
            "--pages",
        ),
        (
            &[
                "pd",
                "--cpu",
                "--scenario",
                "pressure",
                "--chunk-pages",
                "4",
            ],
            "--chunk-pages",
        ),
        (
            &["pd", "--cpu", "--scenario", "pressure", "--iterations", "2"],
            "--iterations",
        ),
        (
            &[
                "pd",
                "--cpu",
                "--scenario",
                "pressure",
                "--methods",
                "ce",
                "--ctas",
                "4",
            ],
            "--ctas",
        ),
    ] {
        refused(args, &format!("{flag} does nothing"));
    }
    refused(
        &[
            "pd",
            "--cpu",
            "--scenario",
            "pressure",
            "--methods",
            "ce,naive",
        ],
        "sends with one method",
    );
    refused(
        &["pd", "--cpu", "--gpus", "0,0,0"],
        "a run on the CPU twin has none",
    );
    refused(&["pd", "--cpu", "--deadline-ms", "0"], "deadline of 0 ms");
    refused(
        &[
            "pd",
            "--cpu",
            "--scenario",
            "pressure",
            "--all-gather",
            "nccl",
        ],
        "NCCL needs GPUs",
    );
}

#[test]
fn role_flags_are_for_started_processes_and_in_range() {
    refused(
        &["pd", "--cpu", "--socket", "/tmp/x"],
        "for the processes a run starts",
    );
    refused(&["pd", "--cpu", "--role", "decode"], "a role process is");
    refused(&["pd", "--cpu", "--rank", "0"], "a role process is");
    refused(
        &[
            "pd", "--cpu", "--role", "encode", "--rank", "0", "--socket", "s",
        ],
        "a role process is",
    );
    refused(
        &[
            "pd", "--cpu", "--role", "prefill", "--rank", "2", "--socket", "s",
        ],
        "rank 2 of a run of 2 ranks",
    );
    refused(
        &[
            "pd", "--cpu", "--role", "decode", "--rank", "1", "--socket", "s",
        ],
        "decode 1 of a run of 2 ranks and 1 decodes",
    );
    refused(
        &["pd", "--cpu", "--role", "decode", "--rank", "0"],
        "without --socket",
    );
    refused(
        &[
            "pd",
            "--cpu",
            "--scenario",
            "pressure",
            "--role",
            "prefill",
            "--rank",
            "0",
            "--socket",
            "s",
        ],
        "without --group",
    );
    let argv = [
        "kvshard", "pd", "--cpu", "--role", "decode", "--rank", "0", "--socket", "s",
    ];
    assert!(parse(argv).is_ok());
}

#[test]
fn shapes_out_of_bounds_are_refused() {
    refused(&["demo", "--cpu", "--ranks", "0"], "1 to 4096 CP ranks");
    refused(
        &["demo", "--cpu", "--layers", "4097"],
        "1 to 4096 target layers",
    );
    refused(
        &["demo", "--cpu", "--chunk", "100"],
        "a non-zero multiple of 64",
    );
    refused(
        &["demo", "--cpu", "--tokens", "0"],
        "a non-zero multiple of 64",
    );
    refused(
        &["demo", "--cpu", "--scenario", "pressure", "--ranks", "3"],
        "not whole pages of 3 ranks",
    );
    refused(&["pd", "--cpu", "--pages", "4,0"], "each at least one page");
    refused(&["pd", "--cpu", "--layers", "0"], "1 to 4096 target layers");
    refused(&["pd", "--cpu", "--iterations", "0"], "no iteration");
    // Sizes that overflow are refused, never wrapped.
    let max = u64::MAX.to_string();
    refused(&["demo", "--cpu", "--tokens", &max], "overflows");
    refused(
        &["demo", "--cpu", "--scenario", "pressure", "--tokens", &max],
        "does not fit",
    );
    refused(&["pd", "--cpu", "--pages", &max], "countable in tokens");
    refused(&["pd", "--cpu", "--chunk-pages", &max], "chunks of");
    refused(&["pd", "--cpu", "--iterations", &max], "iterations");
    // Old behaviour: a pause between chunks of any length was taken (u64::MAX ms slept for
    // ever between two chunks); one not below the decode's deadline makes every request overdue.
    refused(
        &["pd", "--cpu", "--pace-ms", &max],
        "not below the decode's deadline of 300000 ms",
    );
    refused(
        &["pd", "--cpu", "--pace-ms", "1000", "--deadline-ms", "1000"],
        "not below the decode's deadline",
    );
}

/// A scratch folder of this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvshard-flags-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the binary with `args`; it must fail with one line of output, before it starts a
/// process (a run says so in a line of its own first, and its processes' lines follow).
fn binary_refuses(args: &[&str]) -> String {
    let out = Command::new(kvshard_bin()).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stdout}");
    assert_eq!(stdout.lines().count(), 1, "{args:?}: {stdout}");
    assert!(
        !stdout.contains("prefill"),
        "{args:?} started a run: {stdout}"
    );
    stdout
}

#[test]
fn the_binary_refuses_before_any_process_starts_and_leaves_no_report() {
    let dir = scratch("binary");
    let report = dir.join("report.md");
    let path = report.to_str().unwrap();
    for args in [
        &["pd", "--cpu", "--ranks", "4096", "--markdown", path][..],
        &["pd", "--cpu", "--ctas", "0", "--markdown", path],
        &["pd", "--cpu", "--threads", "4096", "--markdown", path],
        &["pd", "--cpu", "--methods", "blocks:0", "--markdown", path],
        &[
            "pd",
            "--cpu",
            "--scenario",
            "pressure",
            "--decodes",
            "9",
            "--markdown",
            path,
        ],
    ] {
        binary_refuses(args);
        assert!(!report.exists(), "{args:?} wrote a report");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unwritable_report_is_refused_before_any_process_starts() {
    let dir = scratch("report");
    let missing = dir.join("no-such-folder").join("report.md");
    let line = binary_refuses(&["pd", "--cpu", "--markdown", missing.to_str().unwrap()]);
    assert!(line.starts_with("--markdown "), "{line}");
    // A folder is no file to write either.
    let line = binary_refuses(&["pd", "--cpu", "--markdown", dir.to_str().unwrap()]);
    assert!(line.starts_with("--markdown "), "{line}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_writes_its_report_over_an_old_one() {
    let dir = scratch("written");
    let report = dir.join("report.md");
    std::fs::write(
        &report,
        "an old report, longer than the new one will be ".repeat(100),
    )
    .unwrap();
    let out = Command::new(kvshard_bin())
        .args([
            "pd",
            "--cpu",
            "--pages",
            "2",
            "--methods",
            "ce",
            "--markdown",
        ])
        .arg(&report)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let table = std::fs::read_to_string(&report).unwrap();
    assert!(table.contains("| 2 | copy engine |"), "{table}");
    assert!(!table.contains("an old report"), "{table}");
    assert!(table.contains("| byte-identical |"), "{table}");
    std::fs::remove_dir_all(&dir).unwrap();
}
