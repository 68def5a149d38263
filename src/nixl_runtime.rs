//! The NIXL runtime (feature `nixl`): loading `libnixl_capi.so` once per process (a typed error
//! when it is missing, where the binding's stub would abort the process) and turning NIXL's
//! statuses into [`Error`]s. A bottom-layer module: the P/D transport
//! ([`crate::transfer::nixl`]) and the storage tier ([`crate::pool::disk`]) both build on it.

use std::ffi::CString;
use std::sync::OnceLock;

use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, NixlError};

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
    "nixl_capi_create_xfer_req",
    "nixl_capi_params_add",
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

/// The dynamic loader's last error on this thread (the NIXL runtime and cuFile are both loaded
/// with `dlopen`).
pub(crate) fn dlerror() -> String {
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

/// One range NIXL registers: process memory (DRAM or VRAM at `addr`) or a whole file (FILE,
/// `device` = its descriptor), described to NIXL as it asks for it.
#[derive(Debug)]
pub(crate) struct Region {
    /// Start address (0 for a file).
    pub(crate) addr: usize,
    /// Bytes.
    pub(crate) len: usize,
    /// NIXL's kind of memory.
    pub(crate) kind: MemType,
    /// NIXL's device id: the GPU ordinal, 0 for DRAM, the file descriptor for a file.
    pub(crate) device: u64,
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
        self.kind
    }

    fn device_id(&self) -> u64 {
        self.device
    }
}
