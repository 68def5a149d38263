//! The [`Backend`] trait: what every backend (the CPU twin, CUDA) offers: memory, ordering on
//! its stream, the kernels and the copy engine.

use super::{check_space, AddressSpace, Buffer, Event, KernelFamily, Launch, MemoryKind, StreamId};
use crate::abi;
use crate::error::Result;

/// A plain 2D copy: `height` rows of `width` bytes, rows `src_pitch` / `dst_pitch` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Copy2d {
    /// Destination address of the first row.
    pub dst: u64,
    /// Bytes between destination rows.
    pub dst_pitch: u64,
    /// Source address of the first row.
    pub src: u64,
    /// Bytes between source rows.
    pub src_pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows.
    pub height: u64,
}

/// A backend: memory, ordering, the kernels and the copy engine.
///
/// Work is ordered as enqueued on the backend's stream; [`Backend::synchronize`] waits for it
/// and reports any input a kernel rejected since the last check. Methods whose names end in
/// `_sync` wait for the stream too; no other method does.
pub trait Backend: Send + Sync {
    /// Short name ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// The stream this backend enqueues on.
    fn stream_id(&self) -> StreamId;

    /// The address space this backend's buffers belong to.
    fn address_space(&self) -> AddressSpace;

    /// Most threads per CTA the kernels of `family` may be launched with on this device.
    fn max_threads(&self, family: KernelFamily) -> u32;

    /// Checks `buffer` belongs to this backend's address space; `what` names it in the error.
    fn check(&self, buffer: &Buffer, what: &str) -> Result<()> {
        check_space(self.address_space(), buffer.space(), what)
    }

    /// Allocates `len` bytes; contents are unspecified. Running out is
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory), never an abort. On CUDA, device memory comes from kvshard's
    /// stream-ordered pool (freed with `cuMemFreeAsync`, which never waits) and pinned host
    /// memory from `cuMemHostAlloc` (freed on kvshard's reaper thread).
    fn alloc(&self, len: usize, kind: MemoryKind) -> Result<Buffer>;

    /// Allocates `len` bytes of device memory that other libraries can register or share by
    /// its address: on CUDA from `cuMemAlloc`, which legacy CUDA IPC (`cuIpcGetMemHandle`),
    /// UCX's `cuda_ipc` (NIXL's VRAM transport) and GPUDirect RDMA and Storage take, and
    /// memory of a stream-ordered pool ([`Backend::alloc`]'s) is not. Its free may wait for
    /// the whole device, the driver's choice: kvshard makes it on its reaper thread, never the
    /// dropping one, but the engine's own CUDA calls may wait behind it. Elsewhere, the same as
    /// [`Backend::alloc`] of device memory.
    fn alloc_registrable(&self, len: usize) -> Result<Buffer> {
        self.alloc(len, MemoryKind::Device)
    }

    /// Copies `data` into `dst` at `offset` after prior work, and waits for it.
    fn write_sync(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()>;

    /// Enqueues a copy of `data` into `dst` at `offset`, ordered after prior work, without
    /// waiting for the stream: `data` has been staged when this returns and may be reused.
    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()>;

    /// Reads `len` bytes of `src` at `offset` after prior work, waiting for it.
    fn read_sync(&self, src: &Buffer, offset: usize, len: usize) -> Result<Vec<u8>>;

    /// Sets every byte of `dst` to `byte` (stream-ordered).
    fn fill(&self, dst: &Buffer, byte: u8) -> Result<()>;

    /// Waits for all enqueued work, then reports the first input any kernel rejected.
    fn synchronize(&self) -> Result<()>;

    /// Reports an input a kernel rejected ([`Error::KernelRejected`](crate::Error::KernelRejected))
    /// among the launches known to have run, without waiting for the stream: the kernel status
    /// word is read only once the stream has passed those launches (on CUDA: a copy of the
    /// word queued behind them, read once its event has completed, so a launch is checked one
    /// call after it ran at the earliest). Each launch is checked once, here or by
    /// [`Backend::synchronize`]. What an asynchronous engine's loop calls every step
    /// (`transfer::PrefillLoop::step`, `HiCacheController::step`).
    fn poll_kernel_status(&self) -> Result<()>;

    /// The process address of `[addr, addr + len)` of this backend's memory where the host
    /// reaches it as plain memory (the CPU twin's arena), `None` where it does not (device
    /// memory): what a storage tier copies host pages through. Accessing it is outside the
    /// stream order: the caller orders it with the stream's work, as a DMA engine would.
    fn host_view(&self, addr: u64, len: usize) -> Result<Option<usize>> {
        let _ = (addr, len);
        Ok(None)
    }

    /// Records an event at the current point of the stream.
    fn record(&self) -> Result<Event>;

    /// Records an event that also marks a time, for [`Backend::elapsed_ms`].
    fn record_timed(&self) -> Result<Event>;

    /// Milliseconds between two timed events of this device, once both have completed.
    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f64>;

    /// Makes later work wait for `event` (recorded on any stream of the same device).
    fn wait(&self, event: &Event) -> Result<()>;

    /// Whether the work before `event` has finished.
    fn is_done(&self, event: &Event) -> Result<bool>;

    /// Blocks the calling thread until the work before `event` has finished.
    fn wait_event_sync(&self, event: &Event) -> Result<()>;

    /// Makes later work wait until the u32 counter at `addr` reaches `value` (wrapping compare).
    ///
    /// # Safety
    /// `addr` must be a 4-byte aligned address of this backend valid until the wait is over.
    unsafe fn wait_counter(&self, addr: u64, value: u32) -> Result<()>;

    /// `kvs_quantize_latent`.
    ///
    /// # Safety
    /// Every address in `p` must be valid for the kernel's documented accesses until the
    /// launch completes.
    unsafe fn quantize_latent(&self, p: abi::kvs_quantize_latent_params) -> Result<()>;

    /// `kvs_quantize_indexer`.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn quantize_indexer(&self, p: abi::kvs_quantize_indexer_params) -> Result<()>;

    /// `kvs_resolve`; `tile_state` must hold [`resolve_state_bytes`](super::resolve_state_bytes) bytes.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn resolve(&self, p: abi::kvs_resolve_params) -> Result<()>;

    /// `kvs_scratch_rows`.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn scratch_rows(&self, p: abi::kvs_scratch_rows_params) -> Result<()>;

    /// `kvs_scratch_table`.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn scratch_table(&self, p: abi::kvs_scratch_table_params) -> Result<()>;

    /// `kvs_copy_blocks` with the given grid.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn copy_blocks(&self, p: abi::kvs_copy_blocks_params, launch: Launch) -> Result<()>;

    /// `kvs_copy_blocks_inline` with the given grid: [`Backend::copy_blocks`] with the pair
    /// table and page ids carried in `p` itself (no upload); table offsets that fall outside
    /// it are refused with [`Error::InvalidArgument`](crate::Error::InvalidArgument) before anything is enqueued.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn copy_blocks_inline(
        &self,
        p: &abi::kvs_copy_blocks_inline_params,
        launch: Launch,
    ) -> Result<()>;

    /// `kvs_write_rows` with the given grid.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn write_rows(&self, p: abi::kvs_write_rows_params, launch: Launch) -> Result<()>;

    /// `kvs_decode_scatter` with the given grid: one prefill rank's chunk into the rows of every
    /// rank of a decode server sharded by token (docs/dcp.md).
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn decode_scatter(
        &self,
        p: abi::kvs_decode_scatter_params,
        launch: Launch,
    ) -> Result<()>;

    /// `kvs_copy_ranges` with the given grid. A range longer than
    /// [`abi::KVS_COPY_RANGE_MAX_BYTES`] is skipped and reported: the next
    /// [`Backend::synchronize`] fails with [`Error::KernelRejected`](crate::Error::KernelRejected) naming its position.
    ///
    /// # Safety
    /// As [`Backend::quantize_latent`].
    unsafe fn copy_ranges(&self, p: abi::kvs_copy_ranges_params, launch: Launch) -> Result<()>;

    /// Copy-engine copy of `len` contiguous bytes.
    ///
    /// # Safety
    /// Both ranges must be valid memory of this backend until the copy completes.
    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> Result<()>;

    /// Copy-engine 2D copy.
    ///
    /// # Safety
    /// Every row of both sides must be valid memory of this backend until the copy completes.
    unsafe fn memcpy_2d(&self, copy: &Copy2d) -> Result<()>;

    /// One copy-engine batch call moving every range (`cudaMemcpyBatchAsync`).
    ///
    /// # Safety
    /// Every range must be valid memory of this backend until the copy completes.
    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use std::sync::Arc;

    use super::*;
    use crate::backend::{cpu, cuda, i64s_to_bytes};
    use crate::error::Error;
    use crate::gpu::Gpu;

    /// The CPU backend, and the CUDA one where a GPU opens (else the test says it skipped the
    /// GPU, or fails where `KVSHARD_REQUIRE_GPU` is set).
    fn twins(test: &str) -> Vec<Arc<dyn Backend>> {
        let mut backends: Vec<Arc<dyn Backend>> = vec![Arc::new(cpu::CpuBackend::new())];
        match Gpu::open(0).and_then(cuda::CudaBackend::new) {
            Ok(gpu) => backends.push(Arc::new(gpu)),
            Err(why) => {
                assert!(
                    std::env::var_os("KVSHARD_REQUIRE_GPU").is_none(),
                    "KVSHARD_REQUIRE_GPU is set but no GPU is usable: {why}"
                );
                let _ = writeln!(std::io::stderr(), "SKIPPED {test} on the GPU: {why}");
            }
        }
        backends
    }

    /// One launch of each block-copy kernel over the same copy: two layer pairs of 2-row blocks
    /// (64 bytes), source pages [3, 0, 2, 1] to destination pages [5, 7, -1, 0] of 6: entry 1
    /// is out of range (reported, skipped) and entry 2 padding. Returns what each left in the
    /// poisoned destination and what the synchronize said.
    fn block_copy_twins(backend: &dyn Backend) -> Vec<(Vec<u8>, Result<()>)> {
        let (block, src_pages, dst_pages) = (64u64, 4u64, 6u64);
        let src = backend
            .alloc((2 * src_pages * block) as usize, MemoryKind::Device)
            .unwrap();
        let dst = backend
            .alloc((2 * dst_pages * block) as usize, MemoryKind::Device)
            .unwrap();
        let data: Vec<u8> = (0..src.len()).map(|i| (i * 13 + 1) as u8).collect();
        backend.write_sync(&src, 0, &data).unwrap();
        let pairs = [
            (src.addr(), dst.addr(), 0u32, 0u32),
            (
                src.addr() + src_pages * block,
                dst.addr() + dst_pages * block,
                0,
                1,
            ),
        ];
        let mut table: Vec<u8> = Vec::new();
        for (s, d, component, signal) in pairs {
            table.extend(s.to_le_bytes());
            table.extend(d.to_le_bytes());
            table.extend(component.to_le_bytes());
            table.extend(signal.to_le_bytes());
        }
        let src_at = table.len() as u64;
        table.extend(i64s_to_bytes(&[3, 0, 2, 1]));
        let dst_at = table.len() as u64;
        table.extend(i64s_to_bytes(&[5, 7, -1, 0]));
        let side = abi::kvs_block_side {
            page_stride: block,
            row_stride: block / 2,
        };
        let mut components = [abi::kvs_block_component::default(); 4];
        components[0] = abi::kvs_block_component {
            rows: 2,
            row_bytes: (block / 2) as u32,
            src: side,
            dst: side,
        };
        let list = |ids, limit| abi::kvs_page_list {
            ids,
            limit,
            kind: abi::KVS_INDEX_LOCAL,
            ..Default::default()
        };
        let params = |tables: u64| abi::kvs_copy_blocks_params {
            components,
            pairs: tables,
            num_pages: 4,
            src_pages: list(tables + src_at, src_pages),
            dst_pages: list(tables + dst_at, dst_pages),
            num_pairs: 2,
            num_components: 1,
            ..Default::default()
        };
        let launch = Launch {
            ctas: 2,
            threads: 64,
        };
        let uploaded = backend.alloc(table.len(), MemoryKind::Device).unwrap();
        backend.write_sync(&uploaded, 0, &table).unwrap();
        let mut inline = abi::kvs_copy_blocks_inline_params {
            copy: params(0),
            ..Default::default()
        };
        for (word, b) in inline.table.iter_mut().zip(table.chunks_exact(8)) {
            *word = u64::from_le_bytes(b.try_into().unwrap());
        }
        let mut out = Vec::new();
        for uploaded_tables in [true, false] {
            backend.fill(&dst, 0xEE).unwrap();
            // SAFETY: every address is inside `src`, `dst` or the table, all alive past the
            // synchronize below; the bad entry is skipped before its page is addressed.
            unsafe {
                if uploaded_tables {
                    backend.copy_blocks(params(uploaded.addr()), launch)
                } else {
                    backend.copy_blocks_inline(&inline, launch)
                }
            }
            .unwrap();
            let said = backend.synchronize();
            out.push((backend.read_sync(&dst, 0, dst.len()).unwrap(), said));
        }
        out
    }

    #[test]
    fn gpu_copy_blocks_inline_moves_and_reports_what_copy_blocks_does() {
        for backend in twins("gpu_copy_blocks_inline_moves_and_reports_what_copy_blocks_does") {
            let runs = block_copy_twins(backend.as_ref());
            // Entries 0 (3 -> 5) and 3 (1 -> 0) move, in both layers; the rest stays poisoned.
            let (block, src_pages, dst_pages) = (64usize, 4usize, 6usize);
            let data: Vec<u8> = (0..2 * src_pages * block)
                .map(|i| (i * 13 + 1) as u8)
                .collect();
            let mut expect = vec![0xEE; 2 * dst_pages * block];
            for layer in 0..2 {
                for (s, d) in [(3, 5), (1, 0)] {
                    let from = (layer * src_pages + s) * block;
                    let to = (layer * dst_pages + d) * block;
                    expect[to..to + block].copy_from_slice(&data[from..from + block]);
                }
            }
            for ((bytes, said), kernel) in runs
                .into_iter()
                .zip(["kvs_copy_blocks", "kvs_copy_blocks_inline"])
            {
                assert!(
                    bytes == expect,
                    "{} {kernel}: the bytes differ",
                    backend.name()
                );
                match said {
                    Err(Error::KernelRejected {
                        kernel: k,
                        position: 1,
                    }) if k == kernel => {}
                    other => panic!(
                        "{} {kernel}: entry 1 was not reported: {other:?}",
                        backend.name()
                    ),
                }
            }
        }
    }

    #[test]
    fn inline_table_offsets_outside_the_table_are_refused_before_anything_runs() {
        let backend = cpu::CpuBackend::new();
        let table = u64::from(abi::KVS_COPY_INLINE_BYTES);
        let mut components = [abi::kvs_block_component::default(); 4];
        components[0] = abi::kvs_block_component {
            rows: 1,
            row_bytes: 16,
            ..Default::default()
        };
        let list = |ids| abi::kvs_page_list {
            ids,
            limit: 1,
            kind: abi::KVS_INDEX_LOCAL,
            ..Default::default()
        };
        let launch = Launch {
            ctas: 1,
            threads: 32,
        };
        // Pairs past the end, ids past the end, an unaligned offset.
        for (pairs, src_ids, dst_ids) in [(table - 8, 0, 8), (0, 24, table - 8 + 1), (4, 24, 32)] {
            let p = abi::kvs_copy_blocks_inline_params {
                copy: abi::kvs_copy_blocks_params {
                    components,
                    pairs,
                    num_pages: 1,
                    src_pages: list(src_ids),
                    dst_pages: list(dst_ids),
                    num_pairs: 1,
                    num_components: 1,
                    ..Default::default()
                },
                ..Default::default()
            };
            // SAFETY: refused before anything is enqueued (what this test checks).
            match unsafe { backend.copy_blocks_inline(&p, launch) } {
                Err(Error::InvalidArgument(why)) => assert!(why.contains("inline"), "{why}"),
                other => panic!("offsets {pairs}/{src_ids}/{dst_ids} not refused: {other:?}"),
            }
        }
        backend.synchronize().unwrap();
    }

    #[test]
    fn copy_ranges_skips_and_reports_ranges_longer_than_the_kernel_takes() {
        let too_long = abi::KVS_COPY_RANGE_MAX_BYTES;
        for backend in twins("copy_ranges_skips_and_reports_ranges_longer_than_the_kernel_takes") {
            let data: Vec<u8> = (1..=64).collect();
            let src = backend.alloc(64, MemoryKind::Device).unwrap();
            let dst = backend.alloc(64, MemoryKind::Device).unwrap();
            backend.write_sync(&src, 0, &data).unwrap();
            backend.fill(&dst, 0xEE).unwrap();
            // A 16-byte aligned range, one 16 bytes too long (the vector path's length), an
            // unaligned range, and one a byte too long (the byte path's). The long ones start
            // inside the buffers too: only the bound keeps them from being copied.
            let ranges = [
                (0, 0, 16),
                (16, 16, too_long + 16),
                (32, 35, 5),
                (48, 48, too_long + 1),
            ];
            let table: Vec<u8> = ranges
                .iter()
                .flat_map(|&(s, d, bytes)| [src.addr() + s, dst.addr() + d, bytes])
                .flat_map(u64::to_le_bytes)
                .collect();
            let table_buffer = backend.alloc(table.len(), MemoryKind::Device).unwrap();
            backend.write_sync(&table_buffer, 0, &table).unwrap();
            let p = abi::kvs_copy_ranges_params {
                ranges: table_buffer.addr(),
                num_ranges: ranges.len() as u64,
                status: abi::kvs_status::default(),
            };
            let launch = Launch {
                ctas: 1,
                threads: 64,
            };
            // SAFETY: the two short ranges lie inside `src` and `dst`, which outlive the
            // synchronize below; the long ones are skipped before their addresses are read
            // (what this test checks).
            unsafe { backend.copy_ranges(p, launch) }.unwrap();
            match backend.synchronize() {
                Err(Error::KernelRejected {
                    kernel: "kvs_copy_ranges",
                    position: 1,
                }) => {}
                other => panic!(
                    "{}: the long ranges were not reported at position 1: {other:?}",
                    backend.name()
                ),
            }
            let mut expect = vec![0xEE; 64];
            expect[..16].copy_from_slice(&data[..16]);
            expect[35..40].copy_from_slice(&data[32..37]);
            assert_eq!(
                backend.read_sync(&dst, 0, 64).unwrap(),
                expect,
                "{}",
                backend.name()
            );
        }
    }

    /// A launch that rejects its input (`kvs_copy_ranges`, a range longer than it takes).
    fn rejected_launch(backend: &dyn Backend) -> (Buffer, Buffer) {
        let src = backend.alloc(64, MemoryKind::Device).unwrap();
        let table: Vec<u8> = [src.addr(), src.addr(), abi::KVS_COPY_RANGE_MAX_BYTES + 1]
            .into_iter()
            .flat_map(u64::to_le_bytes)
            .collect();
        let ranges = backend.alloc(table.len(), MemoryKind::Device).unwrap();
        backend.write_sync(&ranges, 0, &table).unwrap();
        let p = abi::kvs_copy_ranges_params {
            ranges: ranges.addr(),
            num_ranges: 1,
            status: abi::kvs_status::default(),
        };
        let launch = Launch {
            ctas: 1,
            threads: 64,
        };
        // SAFETY: the one range is skipped before its addresses are read (it is too long);
        // the table outlives the launch (returned, and synchronized or polled before dropped).
        unsafe { backend.copy_ranges(p, launch) }.unwrap();
        (src, ranges)
    }

    #[test]
    fn a_rejected_input_is_reported_by_a_poll_without_a_host_wait() {
        let mut backends = twins("a_rejected_input_is_reported_by_a_poll_without_a_host_wait");
        for order in [
            cpu::StreamOrder::Immediate,
            cpu::StreamOrder::Adversarial(7),
        ] {
            backends.push(Arc::new(cpu::CpuBackend::with_order(order)));
        }
        for backend in backends {
            let name = backend.name();
            let _keep = rejected_launch(backend.as_ref());
            let before = crate::backend::sync_counts();
            // The stream runs on its own (the CPU twin: when asked whether it has got there);
            // the first poll may only queue the copy of the status word.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let found = loop {
                match backend.poll_kernel_status() {
                    Ok(()) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_millis(1))
                    }
                    other => break other,
                }
            };
            assert_eq!(
                (crate::backend::sync_counts() - before).host_blocking,
                0,
                "{name}: a poll waited for the stream"
            );
            match found {
                Err(Error::KernelRejected {
                    kernel: "kvs_copy_ranges",
                    position: 0,
                }) => {}
                other => panic!("{name}: the rejected range was not reported: {other:?}"),
            }
            // Reported once: neither a later poll nor a synchronize reports it again, and a
            // launch after it is checked on its own.
            backend.poll_kernel_status().unwrap();
            backend.synchronize().unwrap();
            let _again = rejected_launch(backend.as_ref());
            assert!(
                matches!(backend.synchronize(), Err(Error::KernelRejected { .. })),
                "{name}"
            );
            backend.poll_kernel_status().unwrap();
        }
    }
}
