//! GPUDirect Storage through NIXL's GDS backend (cuFile): device memory <-> a file with no host
//! copy, where it works. This is the measurement the storage tier's device path is judged by,
//! not yet a path of the store (the store's loads go file -> host staging -> host pool -> device).
//!
//! What GDS needs, checked in order by [`probe`] so that a failure says which (NIXL itself
//! only reports that the backend could not be made):
//! 1. NIXL's `libplugin_GDS.so` (or `GDS_MT`) in `NIXL_PLUGIN_DIR` (the `nixl-cu13` wheel ships
//!    both; `scripts/stage-nixl.sh` stages them);
//! 2. `libcudart.so.13` and `libcufile.so.0` (the latter from PyPI's `nvidia-cufile` wheel, not
//!    bundled with NIXL) on the library path;
//! 3. `cuFileDriverOpen` succeeding: without the `nvidia-fs` kernel module cuFile runs only in
//!    compat mode (POSIX I/O through its own bounce buffers), which `cufile.json`'s
//!    `properties.allow_compat_mode` must allow (`CUFILE_ENV_PATH_JSON` names the file).
//!
//! Requests are bounded to [`MAX_IN_FLIGHT`] descriptors: published runs hang GDS with 256 or
//! more I/Os in flight.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nixl_sys::{Agent, MemType, OptArgs, XferDescList, XferOp, XferStatus};

use super::io::new_agent;
use super::slots::storage;
use crate::backend::{Backend, Buffer, MemoryKind};
use crate::error::{Error, Result, StorageFailure};
use crate::nixl_runtime::{dlerror, load, nixl_error, Region};

/// Most descriptors one request has in flight (below the 256 that hang published GDS runs).
pub const MAX_IN_FLIGHT: usize = 128;

/// What [`ceiling_sync`] measured: device memory -> file (write) and file -> device memory
/// (read), as one descriptor of every byte (cuFile's own ceiling for these bytes) and as
/// descriptors of `io_bytes` (a slot, as the store would post them), at most `in_flight` per
/// request.
#[derive(Debug, Clone, PartialEq)]
pub struct GdsCeiling {
    /// NIXL's backend that ran it (`GDS` or `GDS_MT`).
    pub backend: String,
    /// Bytes moved each way per measurement.
    pub bytes: u64,
    /// Bytes of each descriptor of the many-descriptor runs.
    pub io_bytes: u64,
    /// Descriptors per request of the many-descriptor runs.
    pub in_flight: usize,
    /// GB/s device -> file, one descriptor.
    pub one_write_gbps: f64,
    /// GB/s file -> device, one descriptor.
    pub one_read_gbps: f64,
    /// GB/s device -> file, descriptors of `io_bytes`.
    pub many_write_gbps: f64,
    /// GB/s file -> device, descriptors of `io_bytes`.
    pub many_read_gbps: f64,
}

/// `CUfileError_t`: cuFile's status and, for CUDA failures, the CUDA error.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CuFileError {
    err: i32,
    cu_err: i32,
}

fn unavailable(reason: String) -> Error {
    Error::Storage {
        path: "GDS (NIXL GDS backend, cuFile)".into(),
        failure: StorageFailure::Register,
        reason,
    }
}

/// How long cuFile's driver may take to open (it has been seen to hang where no CUDA driver
/// answers).
const DRIVER_OPEN: Duration = Duration::from_secs(30);

/// Checks, in order, what GDS needs (module docs) and says which is missing: the NIXL runtime,
/// its GDS plugin, the CUDA driver, libcudart and libcufile, and cuFile's driver opening (on a
/// thread of its own, waited for at most 30 s). Checked once per process. Errors are
/// [`StorageFailure::Register`] with the reason.
pub fn probe() -> Result<()> {
    load()?;
    static PROBED: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    PROBED.get_or_init(probe_once).clone().map_err(unavailable)
}

fn probe_once() -> std::result::Result<(), String> {
    if let Some(dir) = std::env::var_os("NIXL_PLUGIN_DIR") {
        let dir = std::path::PathBuf::from(dir);
        if !["libplugin_GDS.so", "libplugin_GDS_MT.so"]
            .iter()
            .any(|p| dir.join(p).is_file())
        {
            return Err(format!(
                "no libplugin_GDS.so or libplugin_GDS_MT.so in NIXL_PLUGIN_DIR ({}): stage them with scripts/stage-nixl.sh",
                dir.display()
            ));
        }
    }
    let mut cufile = std::ptr::null_mut();
    for lib in ["libcuda.so.1", "libcudart.so.13", "libcufile.so.0"] {
        let name = std::ffi::CString::new(lib).map_err(|e| e.to_string())?;
        // SAFETY: a plain dlopen by name; the handle stays open for the process (NIXL's plugin
        // loads the same libraries by the same names).
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            let from = match lib {
                "libcufile.so.0" => "PyPI's nvidia-cufile wheel (scripts/stage-nixl.sh stages it)",
                "libcuda.so.1" => "the NVIDIA driver (GDS needs a GPU)",
                _ => "the CUDA 13 runtime",
            };
            return Err(format!(
                "{lib} cannot be loaded ({}): it comes from {from}",
                dlerror()
            ));
        }
        cufile = handle;
    }
    // SAFETY: `cufile` is the live handle of libcufile.so.0; dlsym only looks the name up.
    let open = unsafe { libc::dlsym(cufile, c"cuFileDriverOpen".as_ptr()) };
    if open.is_null() {
        return Err(format!(
            "libcufile.so.0 has no cuFileDriverOpen ({})",
            dlerror()
        ));
    }
    // SAFETY: cufile.h declares `CUfileError_t cuFileDriverOpen(void)`, a struct of two ints
    // returned by value; the symbol was found above. The driver is reference-counted: NIXL's
    // backend opens it again and this reference stays for the process.
    let f =
        unsafe { std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> CuFileError>(open) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvshard-cufile-open".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| format!("cannot spawn the cuFile driver's opener: {e}"))?;
    let status = rx.recv_timeout(DRIVER_OPEN).map_err(|_| {
        format!("cuFileDriverOpen did not return within {DRIVER_OPEN:?} (left on its thread)")
    })?;
    if status.err != 0 {
        return Err(format!(
            "cuFileDriverOpen failed: cuFile error {} (CUDA error {}); without the nvidia-fs kernel module cuFile needs compat mode: point CUFILE_ENV_PATH_JSON at a cufile.json with \"properties\": {{\"allow_compat_mode\": true}}",
            status.err, status.cu_err
        ));
    }
    Ok(())
}

/// Waits for a posted request until `deadline`. Past it the agent is leaked (NIXL may still be
/// moving bytes) and the error says the device memory may still change.
fn wait(agent: &Agent, request: nixl_sys::XferRequest, deadline: Instant) -> Result<()> {
    let started = Instant::now();
    loop {
        match agent
            .get_xfer_status(&request)
            .map_err(nixl_error("getXferStatus"))?
        {
            XferStatus::Success => return Ok(()),
            XferStatus::InProgress if Instant::now() >= deadline => {
                std::mem::forget(request);
                return Err(Error::Timeout {
                    what: "a GDS request (the device memory it names may still be written)".into(),
                    waited: started.elapsed(),
                });
            }
            XferStatus::InProgress => std::thread::sleep(Duration::from_micros(20)),
        }
    }
}

/// Measures GDS on device buffer `vram` (of GPU `gpu`) against a file it makes in `dir` (a
/// filesystem with O_DIRECT), and checks the bytes: a pattern written through `backend` goes
/// to the file, the buffer is zeroed, comes back, and must match; then the same with
/// descriptors of `io_bytes`, `in_flight` per request (at most [`MAX_IN_FLIGHT`]). Each wait
/// is bounded by `timeout`. The file is removed after.
///
/// Errors: what [`probe`] finds missing, NIXL refusing the backend or a registration
/// ([`StorageFailure::Register`], with NIXL's reason), a mismatch ([`Error::Verification`]).
pub fn ceiling_sync(
    backend: &dyn Backend,
    vram: &Buffer,
    gpu: u32,
    dir: &Path,
    io_bytes: u64,
    in_flight: usize,
    timeout: Duration,
) -> Result<GdsCeiling> {
    if vram.kind() != MemoryKind::Device {
        return Err(Error::InvalidArgument(
            "GDS moves device memory: the buffer is host memory".into(),
        ));
    }
    let bytes = vram.len() as u64;
    if io_bytes == 0 || bytes % io_bytes != 0 || io_bytes % 4096 != 0 {
        return Err(Error::InvalidArgument(format!(
            "GDS descriptors of {io_bytes} B over {bytes} B (a multiple of 4 KiB dividing it)"
        )));
    }
    let in_flight = in_flight.clamp(1, MAX_IN_FLIGHT);
    probe()?;
    let name = format!("kvshard-gds-{}", std::process::id());
    let register = |e: Error| unavailable(e.to_string());
    let (agent, _gds, used) = agent_with_gds(&name)?;
    let (path, file) = new_file(dir)?;
    struct Remove<'a>(&'a Path);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _remove = Remove(&path);
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes).map_err(|e| {
        let e = std::io::Error::from(e);
        storage(&path, super::journal::io_failure(&e), e)
    })?;
    let fd = file.as_raw_fd();
    let vram_region = Region {
        addr: vram.addr() as usize,
        len: vram.len(),
        kind: MemType::Vram,
        device: u64::from(gpu),
    };
    let file_region = Region {
        addr: 0,
        len: vram.len(),
        kind: MemType::File,
        device: fd as u64,
    };
    let _vram_reg = agent
        .register_memory(&vram_region, None)
        .map_err(nixl_error("registerMem(VRAM)"))
        .map_err(register)?;
    let _file_reg = agent
        .register_memory(&file_region, None)
        .map_err(nixl_error("registerMem(FILE)"))
        .map_err(register)?;

    let measured = measure(
        backend, &agent, &name, vram, gpu, fd, io_bytes, in_flight, timeout,
    );
    let (one_write_gbps, one_read_gbps, many_write_gbps, many_read_gbps) = match measured {
        Ok(rates) => rates,
        Err(e) => {
            if matches!(e, Error::Timeout { .. }) {
                // NIXL may still move bytes: nothing it uses is released (the error tells the
                // caller its buffer may still be written).
                std::mem::forget(_vram_reg);
                std::mem::forget(_file_reg);
                std::mem::forget(agent);
                std::mem::forget(file);
            }
            return Err(e);
        }
    };
    Ok(GdsCeiling {
        backend: used.into(),
        bytes,
        io_bytes,
        in_flight,
        one_write_gbps,
        one_read_gbps,
        many_write_gbps,
        many_read_gbps,
    })
}

/// A NIXL agent named `name` with a GDS backend (`GDS`, else `GDS_MT`), and which it is.
fn agent_with_gds(name: &str) -> Result<(Agent, nixl_sys::Backend, &'static str)> {
    let agent = new_agent(name).map_err(|e| unavailable(e.to_string()))?;
    let make = |plugin: &str| -> Result<nixl_sys::Backend> {
        let (_mems, params) = agent
            .get_plugin_params(plugin)
            .map_err(nixl_error("getPluginParams"))?;
        agent
            .create_backend(plugin, &params)
            .map_err(nixl_error("createBackend"))
    };
    let (gds, used) = match make("GDS") {
        Ok(b) => (b, "GDS"),
        Err(first) => match make("GDS_MT") {
            Ok(b) => (b, "GDS_MT"),
            Err(second) => {
                return Err(unavailable(format!(
                    "NIXL made no GDS backend: GDS: {first}; GDS_MT: {second}"
                )))
            }
        },
    };
    Ok((agent, gds, used))
}

/// A new file in `dir` (made if missing) for the measurement, opened for direct I/O.
fn new_file(dir: &Path) -> Result<(PathBuf, File)> {
    std::fs::create_dir_all(dir).map_err(|e| storage(dir, StorageFailure::Open, e))?;
    // A new file only (O_EXCL, which never follows a link), this user's alone: a name taken
    // (or a link planted there) is an error, never written through.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let path = dir.join(format!(
        "kvshard-gds-{}-{nanos:08x}.dat",
        std::process::id()
    ));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| storage(&path, StorageFailure::Open, e))?;
    Ok((path, file))
}

/// The four rates of [`ceiling_sync`]: one descriptor write and read, many-descriptor write
/// and read, each read checked against the pattern written.
#[allow(clippy::too_many_arguments)]
fn measure(
    backend: &dyn Backend,
    agent: &Agent,
    name: &str,
    vram: &Buffer,
    gpu: u32,
    fd: i32,
    io_bytes: u64,
    in_flight: usize,
    timeout: Duration,
) -> Result<(f64, f64, f64, f64)> {
    let bytes = vram.len() as u64;
    // One request per `in_flight` descriptors of `size` bytes, one after the other.
    let run = |op: XferOp, size: u64| -> Result<f64> {
        let deadline = Instant::now() + timeout;
        let started = Instant::now();
        let count = bytes / size;
        let mut first = 0u64;
        while first < count {
            let n = (count - first).min(in_flight as u64);
            let mut local = XferDescList::new(MemType::Vram).map_err(nixl_error("xferDlist"))?;
            let mut remote = XferDescList::new(MemType::File).map_err(nixl_error("xferDlist"))?;
            for i in first..first + n {
                local.add_desc(
                    vram.addr() as usize + (i * size) as usize,
                    size as usize,
                    u64::from(gpu),
                );
                remote.add_desc((i * size) as usize, size as usize, fd as u64);
            }
            let args = OptArgs::new().map_err(nixl_error("optArgs"))?;
            let request = agent
                .create_xfer_req(op, &local, &remote, name, Some(&args))
                .map_err(nixl_error("createXferReq"))?;
            let moving = agent
                .post_xfer_req(&request, None)
                .map_err(nixl_error("postXferReq"))?;
            if moving {
                wait(agent, request, deadline)?;
            }
            first += n;
        }
        Ok(bytes as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9)
    };
    let pattern: Vec<u8> = (0..bytes)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) >> 13) as u8)
        .collect();
    let check = |what: &str| -> Result<()> {
        if backend.read_sync(vram, 0, vram.len())? != pattern {
            return Err(Error::Verification(format!(
                "GDS: the bytes read back ({what}) differ from those written"
            )));
        }
        Ok(())
    };
    backend.write_sync(vram, 0, &pattern)?;
    backend.synchronize()?;
    let one_write_gbps = run(XferOp::Write, bytes)?;
    backend.fill(vram, 0)?;
    backend.synchronize()?;
    let one_read_gbps = run(XferOp::Read, bytes)?;
    check("one descriptor")?;
    let many_write_gbps = run(XferOp::Write, io_bytes)?;
    backend.fill(vram, 0)?;
    backend.synchronize()?;
    let many_read_gbps = run(XferOp::Read, io_bytes)?;
    check("many descriptors")?;
    Ok((
        one_write_gbps,
        one_read_gbps,
        many_write_gbps,
        many_read_gbps,
    ))
}
