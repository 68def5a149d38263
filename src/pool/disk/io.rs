//! The store's I/O on NIXL's POSIX backend: one agent per store, the slot files registered once
//! (`FILE_SEG`: offset 0, the file's length, the descriptor as device id), the aligned staging
//! memory registered once (`DRAM_SEG`), and one transfer request per round of descriptors
//! (POSIX posts one I/O per descriptor). io_uring is asked for first; where it is blocked (a
//! container's seccomp profile often refuses `io_uring_setup`) the backend is made with libaio
//! instead and [`IoQueue::Aio`] says why.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, OptArgs, RegistrationHandle, ThreadSync, XferDescList,
    XferOp, XferStatus,
};

use crate::error::{Error, Result, StorageFailure};
use crate::nixl_runtime::{load, nixl_error, Region};

/// Which kernel queue NIXL's POSIX backend runs the store's I/O on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoQueue {
    /// io_uring.
    Uring,
    /// Linux AIO (libaio): io_uring was not used, for the reason given.
    Aio {
        /// Why io_uring was not used (blocked, or not asked for).
        why: String,
    },
}

impl std::fmt::Display for IoQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uring => f.write_str("io_uring"),
            Self::Aio { why } => write!(f, "libaio ({why})"),
        }
    }
}

/// Which queue to ask NIXL for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueChoice {
    /// io_uring, else libaio where io_uring is blocked.
    #[default]
    Auto,
    /// libaio only.
    Aio,
}

/// One I/O: `bytes` at staging offset `staging` <-> file `file` (an index of
/// [`FileIo::add_file`]) at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Io {
    pub staging: u64,
    pub file: usize,
    pub offset: u64,
    pub bytes: u64,
}

/// Aligned process memory, freed on drop.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Drop for Aligned {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated in `FileIo::new` with this layout, freed once.
            unsafe { std::alloc::dealloc(self.ptr, self.layout) };
        }
    }
}

/// The NIXL agent, its POSIX backend, the staging memory and the registered files.
pub(super) struct FileIo {
    /// Registrations first: dropped (deregistered) before the agent, the memory and the files.
    staging_reg: Option<RegistrationHandle>,
    files: Vec<(RegistrationHandle, OwnedFd)>,
    agent: Agent,
    _posix: Backend,
    name: String,
    queue: IoQueue,
    staging: Aligned,
    /// A request that missed its deadline: NIXL may still write the staging memory, so the
    /// store refuses further I/O and never frees that memory (see `Drop`).
    stuck: bool,
}

// SAFETY: the staging pointer is owned memory used only through `&mut self`; the agent
// serializes its own calls (ThreadSync::Rw).
unsafe impl Send for FileIo {}

impl std::fmt::Debug for FileIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileIo")
            .field("agent", &self.name)
            .field("queue", &self.queue)
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

/// A NIXL agent named `name` for the storage tier's own I/O: no progress thread (requests are
/// polled), usable from any thread, no telemetry.
pub(super) fn new_agent(name: &str) -> Result<Agent> {
    let config = AgentConfig {
        enable_prog_thread: false,
        thread_sync: ThreadSync::Rw,
        capture_telemetry: false,
        ..AgentConfig::default()
    };
    Agent::new_configured(name, &config).map_err(nixl_error("createAgent"))
}

impl FileIo {
    /// Agent `name` with a POSIX backend, and `staging_bytes` of staging memory aligned to
    /// `align`, registered.
    pub fn new(
        name: &str,
        choice: QueueChoice,
        staging_bytes: usize,
        align: usize,
    ) -> Result<Self> {
        load()?;
        let register = |e: Error| Error::Storage {
            path: format!("NIXL agent {name}"),
            failure: StorageFailure::Register,
            reason: e.to_string(),
        };
        let agent = new_agent(name).map_err(register)?;
        let make = |param: &str| -> Result<Backend> {
            let (_mems, mut params) = agent
                .get_plugin_params("POSIX")
                .map_err(nixl_error("getPluginParams(POSIX)"))?;
            params
                .set(param, "true")
                .map_err(nixl_error("params.set"))?;
            agent
                .create_backend("POSIX", &params)
                .map_err(nixl_error("createBackend(POSIX)"))
        };
        let (posix, queue) = match choice {
            QueueChoice::Auto => match make("use_uring") {
                Ok(b) => (b, IoQueue::Uring),
                Err(e) => (
                    make("use_aio").map_err(register)?,
                    IoQueue::Aio {
                        why: format!("io_uring unavailable, likely blocked: {e}"),
                    },
                ),
            },
            QueueChoice::Aio => (
                make("use_aio").map_err(register)?,
                IoQueue::Aio {
                    why: "asked for".into(),
                },
            ),
        };
        let layout = std::alloc::Layout::from_size_align(staging_bytes.max(align), align)
            .map_err(|e| Error::InvalidArgument(format!("staging of {staging_bytes} B: {e}")))?;
        // SAFETY: a non-zero size (at least `align`).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::OutOfMemory {
                what: "storage staging".into(),
                bytes: layout.size() as u64,
                memory: "host",
            });
        }
        let staging = Aligned { ptr, layout };
        let region = Region {
            addr: ptr as usize,
            len: layout.size(),
            kind: MemType::Dram,
            device: 0,
        };
        let staging_reg = agent
            .register_memory(&region, None)
            .map_err(nixl_error("registerMem(DRAM)"))
            .map_err(register)?;
        Ok(Self {
            staging_reg: Some(staging_reg),
            files: Vec::new(),
            agent,
            _posix: posix,
            name: name.into(),
            queue,
            staging,
            stuck: false,
        })
    }

    /// The queue the backend runs on.
    pub fn queue(&self) -> &IoQueue {
        &self.queue
    }

    /// Bytes `[from, from + len)` of the staging memory (a range no posted request uses).
    pub fn staging(&mut self, from: usize, len: usize) -> Result<&mut [u8]> {
        if from
            .checked_add(len)
            .is_none_or(|end| end > self.staging.layout.size())
        {
            return Err(Error::HiCache("a range outside the staging memory".into()));
        }
        // SAFETY: inside the allocation (checked), owned by self and borrowed mutably; the
        // callers keep it apart from the ranges of requests in flight.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.staging.ptr.add(from), len) })
    }

    /// Registers `fd` (a file of `len` bytes opened for direct I/O); its index for [`Io::file`].
    pub fn add_file(&mut self, fd: OwnedFd, len: u64, path: &std::path::Path) -> Result<usize> {
        let region = Region {
            addr: 0,
            len: len as usize,
            kind: MemType::File,
            device: fd.as_raw_fd() as u64,
        };
        let reg = self
            .agent
            .register_memory(&region, None)
            .map_err(|e| Error::Storage {
                path: path.display().to_string(),
                failure: StorageFailure::Register,
                reason: format!("NIXL registerMem(FILE): {e}"),
            })?;
        self.files.push((reg, fd));
        Ok(self.files.len() - 1)
    }

    /// Posts `ios` (reads into staging, or writes from it) as one request, without waiting:
    /// `None` for no I/O. Several may be in flight on disjoint staging ranges.
    pub fn post(&mut self, write: bool, ios: &[Io]) -> Result<Option<Posted>> {
        if self.stuck {
            return Err(Error::HiCache(
                "the store's earlier I/O never finished; reopen the store".into(),
            ));
        }
        if ios.is_empty() {
            return Ok(None);
        }
        let nixl = |call| nixl_error(call);
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl("xferDlist"))?;
        let mut remote = XferDescList::new(MemType::File).map_err(nixl("xferDlist"))?;
        let base = self.staging.ptr as usize;
        let size = self.staging.layout.size() as u64;
        for io in ios {
            let fd = self
                .files
                .get(io.file)
                .map(|(_, fd)| fd.as_raw_fd())
                .ok_or_else(|| Error::HiCache(format!("no storage file {}", io.file)))?;
            if io.staging + io.bytes > size {
                return Err(Error::HiCache("an I/O outside the staging memory".into()));
            }
            local.add_desc(base + io.staging as usize, io.bytes as usize, 0);
            remote.add_desc(io.offset as usize, io.bytes as usize, fd as u64);
        }
        let op = if write { XferOp::Write } else { XferOp::Read };
        let args = OptArgs::new().map_err(nixl("optArgs"))?;
        let request = self
            .agent
            .create_xfer_req(op, &local, &remote, &self.name, Some(&args))
            .map_err(nixl("createXferReq"))?;
        let moving = self
            .agent
            .post_xfer_req(&request, None)
            .map_err(nixl("postXferReq"))?;
        Ok(Some(Posted {
            request,
            moving,
            ios: ios.len(),
            started: Instant::now(),
        }))
    }

    /// Waits for a posted request until `deadline`. Past it the store is unusable (NIXL may
    /// still move bytes into the staging memory, which is then never freed).
    pub fn wait_sync(&mut self, posted: Option<Posted>, deadline: Instant) -> Result<()> {
        let Some(Posted {
            request,
            mut moving,
            ios,
            started,
        }) = posted
        else {
            return Ok(());
        };
        let mut spins = 0u32;
        while moving {
            moving = match self
                .agent
                .get_xfer_status(&request)
                .map_err(nixl_error("getXferStatus"))?
            {
                XferStatus::Success => false,
                XferStatus::InProgress => true,
            };
            if moving && Instant::now() >= deadline {
                self.stuck = true;
                // The request stays alive (NIXL may still be moving bytes): never released.
                std::mem::forget(request);
                return Err(Error::Timeout {
                    what: format!("{ios} storage I/Os ({})", self.queue),
                    waited: started.elapsed(),
                });
            }
            // Completions are reaped by these calls (no progress thread): spin briefly, then
            // sleep in short steps so a slow disk does not burn a core.
            spins += 1;
            if moving && spins > 64 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        Ok(())
    }
}

/// A posted request (see [`FileIo::post`]).
pub(super) struct Posted {
    request: nixl_sys::XferRequest,
    moving: bool,
    ios: usize,
    started: Instant,
}

impl Drop for FileIo {
    fn drop(&mut self) {
        if self.stuck {
            // An I/O may still land in the staging memory: keep it (a bounded leak, once).
            let keep = std::mem::replace(
                &mut self.staging,
                Aligned {
                    ptr: std::ptr::null_mut(),
                    layout: std::alloc::Layout::new::<u8>(),
                },
            );
            std::mem::forget(keep);
            std::mem::forget(self.staging_reg.take());
        }
    }
}
