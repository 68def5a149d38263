//! A thin wrapper over one NIXL agent with its UCX backend that turns every NIXL status into an
//! [`Error`] (the library itself is loaded by [`crate::nixl_runtime::load`]).

use nixl_sys::{
    Agent as RawAgent, AgentConfig, Backend as RawBackend, MemType, NotificationMap, OptArgs,
    RegistrationHandle, ThreadSync, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
    XferTelemetry,
};

use crate::error::Result;
pub use crate::nixl_runtime::load;
use crate::nixl_runtime::{nixl_error, Region};

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
            .register_memory(
                &Region {
                    addr,
                    len,
                    kind: memory.mem_type(),
                    device: memory.device,
                },
                None,
            )
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
