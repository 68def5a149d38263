//! The embedded fatbin and its kernels, looked up once by name into a table indexed by
//! [`Kernel`] (no ad-hoc string lookups at launch time), each with the parameter struct it takes
//! ([`KernelFn`]) and the largest CTA its cubin allows.

use std::ffi::CString;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use crate::abi;
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

/// ptxas' resource usage of every kernel on every embedded architecture (registers, spills,
/// stack, most threads per CTA), as build.rs wrote it; empty when built without kernels.
#[cfg(not(kvshard_no_kernels))]
pub const RESOURCE_USAGE: &str = include_str!(env!("KVSHARD_RESOURCE_USAGE"));
/// Built without kernels: nothing to report.
#[cfg(kvshard_no_kernels)]
pub const RESOURCE_USAGE: &str = "";

/// A kernel together with the parameter struct it takes by value, so that launching it with
/// another struct does not compile. One constant per kernel lives in [`kernels`].
pub struct KernelFn<P> {
    kernel: Kernel,
    params: PhantomData<fn(&P)>,
}

// Derives would require `P: Clone` and `P: Debug`; a KernelFn is a plain tag whatever `P` is.
impl<P> Clone for KernelFn<P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P> Copy for KernelFn<P> {}

impl<P> std::fmt::Debug for KernelFn<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("KernelFn").field(&self.kernel).finish()
    }
}

impl<P> KernelFn<P> {
    const fn new(kernel: Kernel) -> Self {
        Self {
            kernel,
            params: PhantomData,
        }
    }

    /// The kernel.
    pub const fn kernel(self) -> Kernel {
        self.kernel
    }

    /// The kernel's symbol in the fatbin.
    pub const fn name(self) -> &'static str {
        self.kernel.name()
    }
}

// An entry's attributes (`#[cfg(..)]`) apply to its variant, its table slot and its constant, so
// a kernel the build leaves out of the fatbin is absent from all three.
macro_rules! kernels {
    ($($(#[$attr:meta])* $variant:ident => $name:literal, $typed:ident: $params:ty;)*) => {
        /// Every kernel in the embedded module.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $(
                $(#[$attr])*
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl Kernel {
            /// All kernels, in table order.
            pub const ALL: &'static [Kernel] = &[$($(#[$attr])* Kernel::$variant,)*];

            /// The kernel's symbol in the fatbin.
            pub const fn name(self) -> &'static str {
                match self {
                    $($(#[$attr])* Kernel::$variant => $name,)*
                }
            }
        }

        /// Every kernel with the parameter struct it takes by value (`()`: none).
        pub mod kernels {
            use super::{abi, Kernel, KernelFn};

            $(
                $(#[$attr])*
                #[doc = concat!("`", $name, "`")]
                pub const $typed: KernelFn<$params> = KernelFn::new(Kernel::$variant);
            )*
        }
    };
}

kernels! {
    QuantizeLatent => "kvs_quantize_latent", QUANTIZE_LATENT: abi::kvs_quantize_latent_params;
    QuantizeIndexer => "kvs_quantize_indexer", QUANTIZE_INDEXER: abi::kvs_quantize_indexer_params;
    ResolveTokens => "kvs_resolve_tokens", RESOLVE_TOKENS: abi::kvs_resolve_params;
    ResolveTokensPow2 => "kvs_resolve_tokens_pow2", RESOLVE_TOKENS_POW2: abi::kvs_resolve_params;
    ResolvePages => "kvs_resolve_pages", RESOLVE_PAGES: abi::kvs_resolve_params;
    ResolvePagesPow2 => "kvs_resolve_pages_pow2", RESOLVE_PAGES_POW2: abi::kvs_resolve_params;
    ScratchRows => "kvs_scratch_rows", SCRATCH_ROWS: abi::kvs_scratch_rows_params;
    ScratchTable => "kvs_scratch_table", SCRATCH_TABLE: abi::kvs_scratch_table_params;
    CopyBlocks => "kvs_copy_blocks", COPY_BLOCKS: abi::kvs_copy_blocks_params;
    CopyBlocksInline => "kvs_copy_blocks_inline", COPY_BLOCKS_INLINE: abi::kvs_copy_blocks_inline_params;
    WriteRows => "kvs_write_rows", WRITE_ROWS: abi::kvs_write_rows_params;
    CopyRanges => "kvs_copy_ranges", COPY_RANGES: abi::kvs_copy_ranges_params;
    DecodeScatterPages => "kvs_decode_scatter_pages", DECODE_SCATTER_PAGES: abi::kvs_decode_scatter_params;
    DecodeScatterRows576 => "kvs_decode_scatter_rows_576", DECODE_SCATTER_ROWS_576: abi::kvs_decode_scatter_params;
    DecodeScatterRows656 => "kvs_decode_scatter_rows_656", DECODE_SCATTER_ROWS_656: abi::kvs_decode_scatter_params;
    DecodeScatterRows1152 => "kvs_decode_scatter_rows_1152", DECODE_SCATTER_ROWS_1152: abi::kvs_decode_scatter_params;
    DecodePackRows576 => "kvs_decode_pack_rows_576", DECODE_PACK_ROWS_576: abi::kvs_decode_scatter_params;
    DecodePackRows656 => "kvs_decode_pack_rows_656", DECODE_PACK_ROWS_656: abi::kvs_decode_scatter_params;
    DecodePackRows1152 => "kvs_decode_pack_rows_1152", DECODE_PACK_ROWS_1152: abi::kvs_decode_scatter_params;
    DecodeUnpackRows576 => "kvs_decode_unpack_rows_576", DECODE_UNPACK_ROWS_576: abi::kvs_decode_scatter_params;
    DecodeUnpackRows656 => "kvs_decode_unpack_rows_656", DECODE_UNPACK_ROWS_656: abi::kvs_decode_scatter_params;
    DecodeUnpackRows1152 => "kvs_decode_unpack_rows_1152", DECODE_UNPACK_ROWS_1152: abi::kvs_decode_scatter_params;
    // cuda/bench.cu, in the fatbin only with feature `bench-kernels` (build.rs).
    #[cfg(feature = "bench-kernels")]
    BenchEmpty => "kvs_bench_empty", BENCH_EMPTY: ();
    #[cfg(feature = "bench-kernels")]
    BenchAdd => "kvs_bench_add", BENCH_ADD: abi::kvs_bench_add_params;
    #[cfg(feature = "bench-kernels")]
    BenchRead => "kvs_bench_read", BENCH_READ: abi::kvs_bench_read_params;
}

/// A loaded module, its function table and each function's largest CTA; unloaded on drop.
pub(crate) struct Module {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
    max_threads: Vec<u32>,
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
            max_threads: Vec::with_capacity(Kernel::ALL.len()),
        };
        for kernel in Kernel::ALL {
            let name = CString::new(kernel.name()).expect("kernel names have no NUL");
            // SAFETY: `module` was just loaded in the current context.
            let f = unsafe { result::module::get_function(loaded.module, name) }
                .map_err(Error::driver("cuModuleGetFunction"))?;
            // The cubin the driver picked for this device decides it (launch bounds, registers),
            // and it may differ by architecture.
            // SAFETY: `f` is a function of the module just loaded in the current context.
            let max_threads = unsafe {
                result::function::get_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                )
            }
            .map_err(Error::driver("cuFuncGetAttribute"))?;
            loaded.functions.push(f);
            loaded.max_threads.push(max_threads.max(0) as u32);
        }
        Ok(loaded)
    }

    pub(crate) fn function(&self, kernel: Kernel) -> sys::CUfunction {
        self.functions[kernel as usize]
    }

    pub(crate) fn max_threads(&self, kernel: Kernel) -> u32 {
        self.max_threads[kernel as usize]
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // On the reaper thread: unloading may wait for the device, like a free.
        let (ctx, module) = (self.ctx.clone(), self.module as usize);
        super::reaper::defer(move || {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: the module was loaded in this context and is unloaded once; no launch
                // can use it any more (the owning Gpu is gone, and every backend keeps its Gpu
                // until the work it launched has completed). A failure leaves nothing to clean up.
                let _ = unsafe { result::module::unload(module as sys::CUmodule) };
            }
        });
    }
}
