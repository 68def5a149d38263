//! Compiles every `cuda/*.cu` with nvcc 13.0.x into one fatbin (sm_90a, sm_100a, sm_103a cubins
//! plus compute_90 PTX) that the crate embeds. Without nvcc the crate still builds: it warns,
//! sets `cfg(kvshard_no_kernels)`, and every GPU entry point returns `Error::KernelsMissing`.
//! Feature `require-kernels` turns a missing or wrong nvcc into a build failure.

use std::env;
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
        Ok(()) => {
            println!("cargo::rustc-env=KVSHARD_FATBIN={}", fatbin.display());
            println!("cargo::rustc-env=KVSHARD_KERNEL_ARCHS={EMBEDDED}");
        }
        Err(why) if required => panic!("feature `require-kernels`: {why}"),
        Err(why) => {
            println!("cargo::warning=kvshard: CUDA kernels not built ({why}); GPU calls will return Error::KernelsMissing. Run scripts/install-cuda.sh to build them.");
            println!("cargo::rustc-cfg=kvshard_no_kernels");
        }
    }
}

fn build(out: &Path, fatbin: &Path) -> Result<(), String> {
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
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cuda)
        .map_err(|e| format!("cannot read {}: {e}", cuda.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    // nvcc builds one fatbin from one translation unit, so the kernels are compiled together.
    let unity = out.join("kvshard_all.cu");
    let body: String = sources
        .iter()
        .map(|s| format!("#include \"{}\"\n", s.display()))
        .collect();
    std::fs::write(&unity, body).map_err(|e| format!("cannot write {}: {e}", unity.display()))?;

    let mut cmd = Command::new(&nvcc);
    cmd.args(["-fatbin", "-O3", "-std=c++17", "-lineinfo"])
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
    Ok(())
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
