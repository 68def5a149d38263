//! Compiles every `cuda/*.cu` (one job per file) with nvcc 13.0.x into one fatbin (sm_90a,
//! sm_100a, sm_103a cubins plus compute_90 PTX) that the crate embeds. `cuda/bench.cu`, the
//! benchmark kernels, only with feature `bench-kernels`: the fatbin engines embed carries no
//! kernel they never launch. Without nvcc the crate still builds: it warns, sets
//! `cfg(kvshard_no_kernels)`, and every GPU entry point returns `Error::KernelsMissing`.
//! Feature `require-kernels` turns a missing or wrong nvcc into a build failure.
//!
//! The same nvcc call reports ptxas' resource usage of every cubin. A kernel that spills or has a
//! stack frame on any embedded architecture fails the build, kernels required or not: local
//! memory traffic in a copy kernel costs the bandwidth it exists for. The per-architecture table
//! goes to `$OUT_DIR/resource-usage.txt`, which the crate embeds (`gpu::RESOURCE_USAGE`).

use std::collections::BTreeMap;
use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// (virtual arch, real arch) pairs, each a `-gencode`; the last line embeds PTX as a fallback.
const GENCODE: &[&str] = &[
    "arch=compute_90a,code=sm_90a",
    "arch=compute_100a,code=sm_100a",
    "arch=compute_103a,code=sm_103a",
    "arch=compute_90,code=compute_90",
];
const EMBEDDED: &str = "sm_90a,sm_100a,sm_103a,compute_90";
/// PTX from newer nvcc is rejected by driver 580 (CUDA 13.0) on the H200 hosts.
const NVCC_RELEASE: &str = "release 13.0";
/// The benchmark kernels' file, compiled only with feature `bench-kernels`.
const BENCH_SOURCE: &str = "bench.cu";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvshard_no_kernels)");
    println!("cargo::rerun-if-changed=cuda");
    for var in ["NVCC", "CUDA_HOME", "KVSHARD_CUDA_PREFIX", "HOME"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let required = env::var_os("CARGO_FEATURE_REQUIRE_KERNELS").is_some();
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let fatbin = out.join("kvshard.fatbin");

    match build(&out, &fatbin) {
        Ok(usage) => {
            let violations = violations(&usage);
            if !violations.is_empty() {
                panic!("kernel resource check failed:\n{violations}");
            }
            let table = out.join("resource-usage.txt");
            std::fs::write(&table, format_table(&usage))
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", table.display()));
            println!("cargo::rustc-env=KVSHARD_FATBIN={}", fatbin.display());
            println!("cargo::rustc-env=KVSHARD_KERNEL_ARCHS={EMBEDDED}");
            println!(
                "cargo::rustc-env=KVSHARD_RESOURCE_USAGE={}",
                table.display()
            );
        }
        Err(why) if required => panic!("feature `require-kernels`: {why}"),
        Err(why) => {
            println!("cargo::warning=kvshard: CUDA kernels not built ({why}); GPU calls will return Error::KernelsMissing. Run scripts/install-cuda.sh to build them.");
            println!("cargo::rustc-cfg=kvshard_no_kernels");
        }
    }
}

fn build(out: &Path, fatbin: &Path) -> Result<Vec<Usage>, String> {
    let nvcc = find_nvcc().ok_or("nvcc not found (set NVCC or CUDA_HOME)")?;
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    let version = String::from_utf8_lossy(&version.stdout);
    if !version.contains(NVCC_RELEASE) {
        return Err(format!(
            "{} is not CUDA 13.0 ({}); PTX from other releases does not load on driver 580",
            nvcc.display(),
            version.lines().last().unwrap_or("unknown version")
        ));
    }

    let cuda = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let bench = env::var_os("CARGO_FEATURE_BENCH_KERNELS").is_some();
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cuda)
        .map_err(|e| format!("cannot read {}: {e}", cuda.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .filter(|p| bench || p.file_name().is_none_or(|n| n != BENCH_SOURCE))
        .collect();
    sources.sort();
    // nvcc builds one fatbin from one translation unit, so the job files are compiled together;
    // each includes what it uses (common.cuh, abi.h) and nothing of another job's.
    let unity = out.join("kvshard_all.cu");
    let body: String = sources
        .iter()
        .map(|s| format!("#include \"{}\"\n", s.display()))
        .collect();
    std::fs::write(&unity, body).map_err(|e| format!("cannot write {}: {e}", unity.display()))?;

    // --keep leaves the PTX of every virtual architecture, whose `.maxntid` are the launch bounds.
    let keep = out.join("nvcc-keep");
    let _ = std::fs::remove_dir_all(&keep);
    std::fs::create_dir_all(&keep).map_err(|e| format!("cannot create {}: {e}", keep.display()))?;
    let mut cmd = Command::new(&nvcc);
    cmd.args([
        "-fatbin",
        "-O3",
        "-std=c++17",
        "-lineinfo",
        "--resource-usage",
        "--keep",
    ])
    .arg("--keep-dir")
    .arg(&keep)
    .arg("-I")
    .arg(&cuda);
    for g in GENCODE {
        cmd.arg("-gencode").arg(g);
    }
    cmd.arg("-o").arg(fatbin).arg(&unity);
    let result = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    if !result.status.success() {
        return Err(format!(
            "nvcc failed:\n{}{}",
            String::from_utf8_lossy(&result.stdout),
            String::from_utf8_lossy(&result.stderr)
        ));
    }
    let bounds = launch_bounds(&keep)?;
    Ok(parse_usage(
        &String::from_utf8_lossy(&result.stderr),
        &bounds,
    ))
}

/// What ptxas reported for one function of one cubin.
struct Usage {
    function: String,
    arch: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
    /// Most threads per CTA the cubin allows: the launch bounds, then the register file.
    max_threads: u32,
}

/// Threads and registers of one CTA at most, and the unit (per warp) registers are allocated
/// in, on every embedded arch.
const CTA_THREADS: u32 = 1024;
const CTA_REGISTERS: u32 = 65536;
const WARP_REGISTER_UNIT: u32 = 256;

/// Parses `--resource-usage` output. ptxas runs once per real architecture, each run opening
/// with a `bytes gmem` line; a run's arch is named on its `Compiling entry function` lines, which
/// may come after the properties of a non-entry function, so a run is read whole first.
fn parse_usage(report: &str, bounds: &BTreeMap<(String, String), u32>) -> Vec<Usage> {
    let mut runs: Vec<Vec<&str>> = Vec::new();
    for line in report.lines() {
        if line.contains("bytes gmem") || runs.is_empty() {
            runs.push(Vec::new());
        }
        runs.last_mut().expect("pushed above").push(line);
    }
    let mut usage = Vec::new();
    for run in runs {
        let Some(arch) = run.iter().find_map(|l| quoted_after(l, "' for ")) else {
            continue;
        };
        let mut lines = run.iter();
        while let Some(line) = lines.next() {
            let Some((_, function)) = line.split_once("Function properties for ") else {
                continue;
            };
            let mut u = Usage {
                function: function.trim().to_string(),
                arch: arch.to_string(),
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
                stack: 0,
                max_threads: 0,
            };
            for line in lines.clone().take(2) {
                u.stack = u.stack.max(number_before(line, " bytes stack frame"));
                u.spill_stores = u
                    .spill_stores
                    .max(number_before(line, " bytes spill stores"));
                u.spill_loads = u.spill_loads.max(number_before(line, " bytes spill loads"));
                u.registers = u.registers.max(number_before(line, " registers"));
            }
            let virtual_arch = arch.replacen("sm_", "compute_", 1);
            let bound = bounds
                .get(&(virtual_arch, u.function.clone()))
                .copied()
                .unwrap_or(CTA_THREADS);
            let warp_registers =
                (u.registers.max(1) * 32).div_ceil(WARP_REGISTER_UNIT) * WARP_REGISTER_UNIT;
            u.max_threads = bound.min(CTA_REGISTERS / warp_registers * 32);
            usage.push(u);
        }
    }
    usage.sort_by(|a, b| (&a.function, arch_rank(&a.arch)).cmp(&(&b.function, arch_rank(&b.arch))));
    usage
}

/// `.maxntid` of every entry of every kept PTX file, by (virtual arch, entry).
fn launch_bounds(keep: &Path) -> Result<BTreeMap<(String, String), u32>, String> {
    let mut bounds = BTreeMap::new();
    let entries =
        std::fs::read_dir(keep).map_err(|e| format!("cannot read {}: {e}", keep.display()))?;
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if path.extension().is_none_or(|x| x != "ptx") {
            continue;
        }
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let Some(arch) = name.split('.').find(|part| part.starts_with("compute_")) else {
            continue;
        };
        let ptx = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut entry = None;
        for line in ptx.lines() {
            if let Some((_, rest)) = line.split_once(".entry ") {
                entry = rest.split('(').next().map(|e| e.trim().to_string());
            } else if line.starts_with('{') {
                entry = None;
            } else if let (Some(e), Some(dims)) = (&entry, line.trim().strip_prefix(".maxntid")) {
                let threads = dims
                    .split(',')
                    .map(|d| d.trim().parse::<u32>().unwrap_or(1))
                    .product();
                bounds.insert((arch.to_string(), e.clone()), threads);
            }
        }
    }
    Ok(bounds)
}

/// The text between the quotes that follow `marker` (`... for 'sm_90a'` gives `sm_90a`).
fn quoted_after<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let (_, rest) = line.split_once(marker)?;
    rest.strip_prefix('\'')?.split('\'').next()
}

/// The number just before `suffix` in `line`, 0 if absent.
fn number_before(line: &str, suffix: &str) -> u32 {
    line.split_once(suffix)
        .and_then(|(head, _)| head.rsplit(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Position of a real arch in the embedded order.
fn arch_rank(arch: &str) -> usize {
    EMBEDDED
        .split(',')
        .position(|a| a == arch)
        .unwrap_or(usize::MAX)
}

/// One line per embedded cubin ptxas said nothing about (the check could not run) and per
/// function that spills or has a stack frame; empty when all is well.
fn violations(usage: &[Usage]) -> String {
    let mut out = String::new();
    for arch in EMBEDDED.split(',').filter(|a| a.starts_with("sm_")) {
        if !usage.iter().any(|u| u.arch == arch) {
            let _ = writeln!(out, "  no ptxas resource usage for {arch} in nvcc's output");
        }
    }
    for u in usage
        .iter()
        .filter(|u| u.spill_stores + u.spill_loads + u.stack > 0)
    {
        let _ = writeln!(
            out,
            "  {} on {}: {} B spill stores, {} B spill loads, {} B stack frame ({} registers); \
             it needs fewer registers or a larger budget (launch bounds) there",
            u.function, u.arch, u.spill_stores, u.spill_loads, u.stack, u.registers
        );
    }
    out
}

fn format_table(usage: &[Usage]) -> String {
    let mut table = format!(
        "{:<24} {:<8} {:>9} {:>12} {:>11} {:>5} {:>11}\n",
        "kernel", "arch", "registers", "spill stores", "spill loads", "stack", "max threads"
    );
    for u in usage {
        let _ = writeln!(
            table,
            "{:<24} {:<8} {:>9} {:>12} {:>11} {:>5} {:>11}",
            u.function, u.arch, u.registers, u.spill_stores, u.spill_loads, u.stack, u.max_threads
        );
    }
    table
}

/// `$NVCC`, then `$CUDA_HOME/bin/nvcc`, then the prefix scripts/install-cuda.sh uses by default,
/// then `nvcc` on the PATH.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(nvcc) = env::var_os("NVCC") {
        return Some(PathBuf::from(nvcc));
    }
    let mut candidates = Vec::new();
    if let Some(home) = env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("bin/nvcc"));
    }
    let prefix = env::var_os("KVSHARD_CUDA_PREFIX")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvshard/cuda-13.0")));
    if let Some(prefix) = prefix {
        candidates.push(prefix.join("nvidia/cu13/bin/nvcc"));
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.into_iter().find(|c| c.is_file())
}
