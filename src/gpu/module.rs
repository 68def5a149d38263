//! The embedded fatbin and its kernels, looked up once by name into a table indexed by
//! [`Kernel`] (no ad-hoc string lookups at launch time).

use std::ffi::CString;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::error::{Error, Result};

/// The driver wants an image it can read as 8-byte words; `include_bytes!` only promises 1.
#[cfg(not(kvshard_no_kernels))]
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

#[cfg(not(kvshard_no_kernels))]
static FATBIN_BYTES: &Aligned<[u8]> = &Aligned(*include_bytes!(env!("KVSHARD_FATBIN")));

/// The fatbin built by build.rs, when nvcc was present.
#[cfg(not(kvshard_no_kernels))]
pub(crate) const FATBIN: Option<&'static [u8]> = Some(&FATBIN_BYTES.0);
#[cfg(kvshard_no_kernels)]
pub(crate) const FATBIN: Option<&'static [u8]> = None;

/// Architectures build.rs embedded.
#[cfg(not(kvshard_no_kernels))]
pub(crate) const ARCHS: &str = env!("KVSHARD_KERNEL_ARCHS");
#[cfg(kvshard_no_kernels)]
pub(crate) const ARCHS: &str = "";

macro_rules! kernels {
    ($($variant:ident => $name:literal,)*) => {
        /// Every kernel in the embedded module.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl Kernel {
            /// All kernels, in table order.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The kernel's symbol in the fatbin.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $name,)*
                }
            }
        }
    };
}

kernels! {
    QuantizeLatent => "kvs_quantize_latent",
    QuantizeIndexer => "kvs_quantize_indexer",
    ResolveTokens => "kvs_resolve_tokens",
    ResolveTokensPow2 => "kvs_resolve_tokens_pow2",
    ResolvePages => "kvs_resolve_pages",
    ResolvePagesPow2 => "kvs_resolve_pages_pow2",
    ScratchRows => "kvs_scratch_rows",
    CopyBlocks => "kvs_copy_blocks",
    WriteRows => "kvs_write_rows",
    CopyRanges => "kvs_copy_ranges",
    BenchEmpty => "kvs_bench_empty",
    BenchAdd => "kvs_bench_add",
    BenchRead => "kvs_bench_read",
}

/// A loaded module and its function table; unloaded on drop.
pub(crate) struct Module {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread once the
// owning context is current (every use binds it first).
unsafe impl Send for Module {}
// SAFETY: see Send; the table is never mutated after load.
unsafe impl Sync for Module {}

impl Module {
    pub(crate) fn load(ctx: &Arc<CudaContext>, fatbin: &'static [u8]) -> Result<Module> {
        ctx.bind_to_thread()
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        // SAFETY: `fatbin` is a complete, 64-byte aligned fatbin image embedded at build time.
        let module = unsafe { result::module::load_data(fatbin.as_ptr().cast()) }
            .map_err(Error::driver("cuModuleLoadData"))?;
        let mut loaded = Module {
            ctx: ctx.clone(),
            module,
            functions: Vec::with_capacity(Kernel::ALL.len()),
        };
        for kernel in Kernel::ALL {
            let name = CString::new(kernel.name()).expect("kernel names have no NUL");
            // SAFETY: `module` was just loaded in the current context.
            let f = unsafe { result::module::get_function(loaded.module, name) }
                .map_err(Error::driver("cuModuleGetFunction"))?;
            loaded.functions.push(f);
        }
        Ok(loaded)
    }

    pub(crate) fn function(&self, kernel: Kernel) -> sys::CUfunction {
        self.functions[kernel as usize]
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the module was loaded in this context and no launch can use it any more
            // (the owning Gpu is being dropped). A failure here leaves nothing to clean up.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}
