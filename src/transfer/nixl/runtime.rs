//! The NIXL runtime: loading `libnixl_capi.so` (a typed error when it is missing, where the
//! binding's stub would abort the process), and a thin wrapper over one NIXL agent with its UCX
//! backend that turns every NIXL status into an [`Error`].

use std::ffi::CString;
use std::sync::OnceLock;

use nixl_sys::{
    Agent as RawAgent, AgentConfig, Backend as RawBackend, MemType, MemoryRegion, NixlDescriptor,
    NixlError, NotificationMap, OptArgs, RegistrationHandle, ThreadSync, XferDescList,
    XferDlistHandle, XferOp, XferRequest, XferStatus, XferTelemetry,
};

use crate::error::{Error, Result};

/// The library the binding's stub loads at run time.
const LIBRARY: &str = "libnixl_capi.so";

/// Every C API entry point kvshard reaches through the binding: checked once at load, because
/// the stub aborts the process on the first call of a symbol it cannot find.
const SYMBOLS: &[&str] = &[
    "nixl_capi_create_configured_agent",
    "nixl_capi_destroy_agent",
    "nixl_capi_get_plugin_params",
    "nixl_capi_params_create_iterator",
    "nixl_capi_params_iterator_next",
    "nixl_capi_params_destroy_iterator",
    "nixl_capi_destroy_params",
    "nixl_capi_destroy_mem_list",
    "nixl_capi_create_backend",
    "nixl_capi_destroy_backend",
    "nixl_capi_create_opt_args",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_opt_args_set_notif_msg",
    "nixl_capi_opt_args_set_has_notif",
    "nixl_capi_opt_args_set_skip_desc_merge",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_reg_dlist_clear",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_register_mem",
    "nixl_capi_deregister_mem",
    "nixl_capi_get_local_md",
    "nixl_capi_load_remote_md",
    "nixl_capi_invalidate_remote_md",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_xfer_dlist_clear",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_prep_xfer_dlist",
    "nixl_capi_release_xfer_dlist_handle",
    "nixl_capi_make_xfer_req",
    "nixl_capi_post_xfer_req",
    "nixl_capi_get_xfer_status",
    "nixl_capi_get_xfer_telemetry",
    "nixl_capi_release_xfer_req",
    "nixl_capi_destroy_xfer_req",
    "nixl_capi_gen_notif",
    "nixl_capi_create_notif_map",
    "nixl_capi_destroy_notif_map",
    "nixl_capi_get_notifs",
    "nixl_capi_notif_map_size",
    "nixl_capi_notif_map_get_agent_at",
    "nixl_capi_notif_map_get_notifs_size",
    "nixl_capi_notif_map_get_notif",
    "nixl_capi_notif_map_clear",
];

/// What to tell the user when the library is missing.
const INSTALL: &str = "install the nixl-cu13 1.5.x wheel with scripts/install-nixl.sh and put the \
     folder it prints on LD_LIBRARY_PATH";

/// Loads the NIXL C API once per process and checks every entry point kvshard uses.
///
/// The handle stays open for the life of the process: the binding's stub opens the library by
/// the same name, which then resolves to this already loaded copy.
pub fn load() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(open)
        .clone()
        .map_err(|why| Error::NixlUnavailable { why })
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread, copied out at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

fn open() -> std::result::Result<(), String> {
    let name = CString::new(LIBRARY).map_err(|e| e.to_string())?;
    // SAFETY: a plain dlopen of a library by name; its initializers are NIXL's own (the stub
    // would run the same ones on its first call). RTLD_LOCAL as the stub opens it.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!(
            "{LIBRARY} could not be loaded ({}): {INSTALL}",
            dlerror()
        ));
    }
    let missing: Vec<&str> = SYMBOLS
        .iter()
        .copied()
        .filter(|symbol| {
            let Ok(c) = CString::new(*symbol) else {
                return true;
            };
            // SAFETY: `handle` is the live handle opened above; dlsym only looks the name up.
            unsafe { libc::dlsym(handle, c.as_ptr()).is_null() }
        })
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{LIBRARY} lacks {} (another NIXL version?): {INSTALL}",
            missing.join(", ")
        ));
    }
    Ok(())
}

/// A NIXL status as an [`Error`].
pub(crate) fn nixl_error(call: &'static str) -> impl FnOnce(NixlError) -> Error {
    move |e| Error::Nixl {
        call,
        reason: e.to_string(),
    }
}

/// NIXL's kind of memory for the regions and descriptors of one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Memory {
    pub vram: bool,
    pub device: u64,
}

impl Memory {
    fn mem_type(self) -> MemType {
        if self.vram {
            MemType::Vram
        } else {
            MemType::Dram
        }
    }
}

/// One registered region: what [`Agent::register`] hands NIXL.
#[derive(Debug)]
struct Region {
    addr: usize,
    len: usize,
    memory: Memory,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        self.memory.mem_type()
    }

    fn device_id(&self) -> u64 {
        self.memory.device
    }
}

/// A prepared descriptor list of this agent (local, or of one remote agent).
pub(crate) struct Prepared {
    /// Released on drop, through the raw agent pointer it holds: declared before `_agent`, so
    /// it drops first, while the agent is certainly alive.
    handle: XferDlistHandle,
    /// A share of the agent (the binding's handle holds only a raw pointer to it).
    _agent: RawAgent,
}

// SAFETY: the handle is a pointer to a descriptor list the NIXL agent allocated and owns until
// it is released (on drop); nothing ties it to the thread that prepared it, and the agent
// serializes its own calls (it is created with a reader-writer lock, ThreadSync::Rw). kvshard
// uses it only behind `&mut` of its owner or a mutex.
unsafe impl Send for Prepared {}

/// One NIXL agent with a UCX backend, created with a progress thread (transfers and
/// notifications progress without being polled) and telemetry (post and transfer times of each
/// request, as NIXL measured them).
pub(crate) struct Agent {
    agent: RawAgent,
    /// Owned by the agent (destroyed with it); kept to name the backend in calls.
    _ucx: RawBackend,
    name: String,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A posted transfer's state.
pub(crate) enum Progress {
    Moving,
    Done,
}

impl Agent {
    /// Loads the library (a typed error when it is missing) and creates agent `name` with its
    /// UCX backend.
    pub fn new(name: &str) -> Result<Self> {
        load()?;
        let config = AgentConfig {
            enable_prog_thread: true,
            thread_sync: ThreadSync::Rw,
            capture_telemetry: true,
            ..AgentConfig::default()
        };
        let agent = RawAgent::new_configured(name, &config).map_err(nixl_error("createAgent"))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(nixl_error("getPluginParams(UCX)"))?;
        let ucx = agent
            .create_backend("UCX", &params)
            .map_err(nixl_error("createBackend(UCX)"))?;
        Ok(Self {
            agent,
            _ucx: ucx,
            name: name.to_string(),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Registers `[addr, addr + len)`; deregistered when the handle drops.
    ///
    /// # Safety
    /// The range must be memory of the kind `memory` says, valid until the handle has been
    /// dropped, and no transfer may use it after that.
    pub unsafe fn register(
        &self,
        addr: usize,
        len: usize,
        memory: Memory,
    ) -> Result<RegistrationHandle> {
        self.agent
            .register_memory(&Region { addr, len, memory }, None)
            .map_err(nixl_error("registerMem"))
    }

    /// The agent's metadata, for the peer to load.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.agent.get_local_md().map_err(nixl_error("getLocalMD"))
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub fn load_remote(&self, metadata: &[u8]) -> Result<String> {
        self.agent
            .load_remote_md(metadata)
            .map_err(nixl_error("loadRemoteMD"))
    }

    /// Drops what the agent holds of peer `agent` (its metadata and connection).
    pub fn forget(&self, agent: &str) {
        // Already forgotten, or never loaded: nothing to drop either way.
        let _ = self.agent.invalidate_remote_md(agent);
    }

    /// Prepares `descs` (address, length) of this agent (`remote` = None) or of a peer.
    pub fn prepare(
        &self,
        remote: Option<&str>,
        memory: Memory,
        descs: impl Iterator<Item = (u64, u64)>,
    ) -> Result<Prepared> {
        let mut list = XferDescList::new(memory.mem_type()).map_err(nixl_error("xferDlist"))?;
        for (addr, bytes) in descs {
            list.add_desc(addr as usize, bytes as usize, memory.device);
        }
        let handle = self
            .agent
            .prepare_xfer_dlist(remote.unwrap_or(""), &list, None)
            .map_err(nixl_error("prepXferDlist"))?;
        Ok(Prepared {
            handle,
            _agent: self.agent.clone(),
        })
    }

    /// Makes a write from `local[li[k]]` to `remote[ri[k]]` for every k, with notification
    /// `notice`; consecutive descriptors contiguous on both sides merge unless `per_block`.
    pub fn make_write(
        &self,
        local: &Prepared,
        li: &[i32],
        remote: &Prepared,
        ri: &[i32],
        notice: &[u8],
        per_block: bool,
    ) -> Result<XferRequest> {
        let mut args = OptArgs::new().map_err(nixl_error("optArgs"))?;
        args.set_notification_message(notice)
            .map_err(nixl_error("optArgs.notifMsg"))?;
        args.set_has_notification(true)
            .map_err(nixl_error("optArgs.hasNotif"))?;
        args.set_skip_descriptor_merge(per_block)
            .map_err(nixl_error("optArgs.skipDescMerge"))?;
        self.agent
            .make_xfer_req(
                XferOp::Write,
                &local.handle,
                li,
                &remote.handle,
                ri,
                Some(&args),
            )
            .map_err(nixl_error("makeXferReq"))
    }

    /// Posts a request.
    pub fn post(&self, request: &XferRequest) -> Result<()> {
        self.agent
            .post_xfer_req(request, None)
            .map(|_| ())
            .map_err(nixl_error("postXferReq"))
    }

    /// Where a posted request stands; a failed transfer is an error.
    pub fn progress(&self, request: &XferRequest) -> Result<Progress> {
        match self
            .agent
            .get_xfer_status(request)
            .map_err(nixl_error("getXferStatus"))?
        {
            XferStatus::Success => Ok(Progress::Done),
            XferStatus::InProgress => Ok(Progress::Moving),
        }
    }

    /// NIXL's telemetry of a finished request (`None` when it has none).
    pub fn telemetry(request: &XferRequest) -> Option<XferTelemetry> {
        request.get_telemetry().ok()
    }

    /// Sends `message` to peer `agent` as a notification, with no transfer.
    pub fn notify(&self, agent: &str, message: &[u8]) -> Result<()> {
        self.agent
            .send_notification(agent, message, None)
            .map_err(nixl_error("genNotif"))
    }

    /// Takes every notification that arrived: (sending agent, message).
    pub fn notifications(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let mut map = NotificationMap::new().map_err(nixl_error("notifMap"))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(nixl_error("getNotifs"))?;
        let mut out = Vec::new();
        let agents: Vec<String> = map
            .agents()
            .map(|a| a.map(str::to_string))
            .collect::<std::result::Result<_, _>>()
            .map_err(nixl_error("getNotifs.agents"))?;
        for agent in agents {
            for message in map
                .get_notifications(&agent)
                .map_err(nixl_error("getNotifs.messages"))?
            {
                out.push((
                    agent.clone(),
                    message.map_err(nixl_error("getNotifs.message"))?,
                ));
            }
        }
        Ok(out)
    }
}
