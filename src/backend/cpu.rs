//! The CPU reference backend: the twin of every kernel, with the same parameter structs and the
//! same semantics, on an address space of its own (so a plan's addresses mean the same thing
//! here as on the GPU). Work runs when it is enqueued; events are always complete.
//!
//! Each twin below is the specification its kernel is tested against, byte for byte.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use half::bf16;

use super::status::{raise, StatusTracker};
use super::{check, Backend, Buffer, Copy2d, Launch, MemoryKind};
use crate::abi;
use crate::error::{Error, Result};
use crate::fp8;
use crate::geometry::{
    IndexerScale, LatentLayout, INDEXER_HEAD_DIM, INDEXER_PAGE_BYTES, INDEXER_SCALES_OFFSET,
    LATENT_DIM, PAGE_SIZE,
};
use crate::shard::Placement;

/// First address handed out; allocations are 256-byte aligned with unmapped gaps between them,
/// so an out-of-bounds access is an error here just as it would be a fault on the GPU.
const BASE: u64 = 0x1000_0000_0000;
const GAP: u64 = 1 << 20;

#[derive(Debug, Default)]
struct Arena {
    allocs: BTreeMap<u64, Vec<u8>>,
    next: u64,
}

impl Arena {
    fn locate(&self, addr: u64, len: usize) -> Result<(u64, usize)> {
        if let Some((&base, bytes)) = self.allocs.range(..=addr).next_back() {
            let offset = (addr - base) as usize;
            if offset
                .checked_add(len)
                .is_some_and(|end| end <= bytes.len())
            {
                return Ok((base, offset));
            }
        }
        Err(Error::InvalidArgument(format!(
            "CPU backend: [{addr:#x}, +{len}) is not inside one allocation"
        )))
    }

    fn bytes(&self, addr: u64, len: usize) -> Result<&[u8]> {
        let (base, offset) = self.locate(addr, len)?;
        Ok(&self.allocs[&base][offset..offset + len])
    }

    fn bytes_mut(&mut self, addr: u64, len: usize) -> Result<&mut [u8]> {
        let (base, offset) = self.locate(addr, len)?;
        let alloc = self
            .allocs
            .get_mut(&base)
            .expect("located allocation exists");
        Ok(&mut alloc[offset..offset + len])
    }

    fn copy(&mut self, dst: u64, src: u64, len: usize) -> Result<()> {
        let data = self.bytes(src, len)?.to_vec();
        self.bytes_mut(dst, len)?.copy_from_slice(&data);
        Ok(())
    }

    fn i64_at(&self, addr: u64) -> Result<i64> {
        Ok(i64::from_le_bytes(
            self.bytes(addr, 8)?.try_into().expect("8 bytes"),
        ))
    }

    fn u64_at(&self, addr: u64) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.bytes(addr, 8)?.try_into().expect("8 bytes"),
        ))
    }

    fn set_u64(&mut self, addr: u64, v: u64) -> Result<()> {
        self.bytes_mut(addr, 8)?.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }

    fn pairs(&self, addr: u64, n: u32) -> Result<Vec<abi::kvs_layer_pair>> {
        (0..u64::from(n))
            .map(|k| {
                let at = addr + 24 * k;
                let tail = self.bytes(at + 16, 8)?;
                Ok(abi::kvs_layer_pair {
                    src: self.u64_at(at)?,
                    dst: self.u64_at(at + 8)?,
                    component: u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")),
                    signal: u32::from_le_bytes(tail[4..].try_into().expect("4 bytes")),
                })
            })
            .collect()
    }
}

/// Frees its allocation from the arena when the last buffer sharing it is dropped.
struct CpuAllocation {
    arena: Weak<Mutex<Arena>>,
    base: u64,
}

impl Drop for CpuAllocation {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.upgrade() {
            lock(&arena).allocs.remove(&self.base);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The CPU reference backend.
pub struct CpuBackend {
    arena: Arc<Mutex<Arena>>,
    status: Mutex<StatusTracker>,
    /// Keeps the status word's allocation alive.
    _status_word: Buffer,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend").finish_non_exhaustive()
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend with an empty address space.
    pub fn new() -> Self {
        let arena = Arc::new(Mutex::new(Arena {
            allocs: BTreeMap::new(),
            next: BASE,
        }));
        let word = Self::alloc_in(&arena, 8, MemoryKind::Device);
        lock(&arena)
            .set_u64(word.addr(), 0)
            .expect("fresh status word");
        Self {
            status: Mutex::new(StatusTracker::new(word.addr())),
            arena,
            _status_word: word,
        }
    }

    /// Another backend on the same address space, like a second stream of the same device:
    /// buffers of either are valid in both; each keeps its own kernel status.
    pub fn new_stream(&self) -> Self {
        let word = Self::alloc_in(&self.arena, 8, MemoryKind::Device);
        Self {
            status: Mutex::new(StatusTracker::new(word.addr())),
            arena: self.arena.clone(),
            _status_word: word,
        }
    }

    fn alloc_in(arena: &Arc<Mutex<Arena>>, len: usize, kind: MemoryKind) -> Buffer {
        let mut a = lock(arena);
        let base = a.next;
        a.next = (base + len as u64 + GAP).next_multiple_of(256);
        a.allocs.insert(base, vec![0; len]);
        let owner = Arc::new(CpuAllocation {
            arena: Arc::downgrade(arena),
            base,
        });
        Buffer::owned(base, len, kind, owner)
    }

    fn mem(&self) -> MutexGuard<'_, Arena> {
        lock(&self.arena)
    }

    fn begin(&self, kernel: &'static str) -> abi::kvs_status {
        lock(&self.status).begin(kernel)
    }
}

/// Raises the status word in `mem` for a bad input at `position`.
fn report(mem: &mut Arena, status: &abi::kvs_status, position: u64) -> Result<()> {
    if status.word == 0 {
        return Ok(());
    }
    let mut word = mem.u64_at(status.word)?;
    raise(&mut word, status, position);
    mem.set_u64(status.word, word)
}

fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// The CPU twin of `resolve_page` in cuda/copy.cu.
fn resolve_page(
    mem: &mut Arena,
    list: &abi::kvs_page_list,
    j: u64,
    status: &abi::kvs_status,
) -> Result<Option<u64>> {
    let page = if list.kind == abi::KVS_INDEX_POSITION {
        j
    } else {
        let id = mem.i64_at(list.ids + 8 * j)?;
        if id < 0 {
            return Ok(None);
        }
        if list.kind == abi::KVS_INDEX_LOGICAL {
            let placement = Placement::new(list.shard)?;
            if placement.owner(id as u64) != list.rank {
                return Ok(None);
            }
            placement.local_page(id as u64)
        } else {
            id as u64
        }
    };
    if page >= list.limit {
        report(mem, status, j)?;
        return Ok(None);
    }
    Ok(Some(page))
}

impl Backend for CpuBackend {
    type Event = ();

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, len: usize, kind: MemoryKind) -> Result<Buffer> {
        Ok(Self::alloc_in(&self.arena, len, kind))
    }

    fn write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.mem()
            .bytes_mut(dst.at(offset)?, data.len())?
            .copy_from_slice(data);
        Ok(())
    }

    fn enqueue_write(&self, dst: &Buffer, offset: usize, data: &[u8]) -> Result<()> {
        self.write(dst, offset, data)
    }

    fn read(&self, src: &Buffer, offset: usize, len: usize) -> Result<Vec<u8>> {
        Ok(self.mem().bytes(src.at(offset)?, len)?.to_vec())
    }

    fn fill(&self, dst: &Buffer, byte: u8) -> Result<()> {
        self.mem().bytes_mut(dst.addr(), dst.len())?.fill(byte);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        let word = {
            let status = lock(&self.status);
            if !status.has_pending() {
                return Ok(());
            }
            self.mem().u64_at(self._status_word.addr())?
        };
        lock(&self.status).check(word)
    }

    fn record(&self) -> Result<()> {
        Ok(())
    }

    fn wait(&self, _event: &()) -> Result<()> {
        Ok(())
    }

    fn is_done(&self, _event: &()) -> Result<bool> {
        Ok(true)
    }

    unsafe fn wait_counter(&self, addr: u64, value: u32) -> Result<()> {
        let mem = self.mem();
        let bytes = mem.bytes(addr, 4)?;
        let counter = u32::from_le_bytes(bytes.try_into().expect("4 bytes"));
        // Work here completes as it is enqueued: a counter that has not arrived never will.
        if (counter.wrapping_sub(value) as i32) < 0 {
            return Err(Error::InvalidArgument(format!(
                "counter at {addr:#x} is {counter} and can never reach {value}: the wait would hang on a GPU"
            )));
        }
        Ok(())
    }

    unsafe fn quantize_latent(&self, mut p: abi::kvs_quantize_latent_params) -> Result<()> {
        check::quantize_latent(&p)?;
        p.status = self.begin("kvs_quantize_latent");
        let layout = match p.layout {
            abi::KVS_LATENT_FP8_TRTLLM => LatentLayout::Fp8Trtllm,
            abi::KVS_LATENT_FP8_SCALED => LatentLayout::Fp8Scaled,
            _ => LatentLayout::Bf16,
        };
        let row_bytes = layout.row_bytes();
        let mut mem = self.mem();
        let mut row = vec![0u8; row_bytes];
        for token in 0..p.num_tokens {
            let slot = mem.i64_at(p.slots + 8 * token)?;
            if slot < 0 {
                continue;
            }
            if slot as u64 >= p.dst_rows {
                report(&mut mem, &p.status, token)?;
                continue;
            }
            let input = bf16s(mem.bytes(p.src + token * p.src_stride, 2 * LATENT_DIM)?);
            fp8::quantize_latent_row(layout, &input, &mut row);
            mem.bytes_mut(p.dst + slot as u64 * row_bytes as u64, row_bytes)?
                .copy_from_slice(&row);
        }
        Ok(())
    }

    unsafe fn quantize_indexer(&self, mut p: abi::kvs_quantize_indexer_params) -> Result<()> {
        check::quantize_indexer(&p)?;
        p.status = self.begin("kvs_quantize_indexer");
        let kind = if p.scale == abi::KVS_SCALE_UE8M0 {
            IndexerScale::Ue8m0
        } else {
            IndexerScale::Plain
        };
        let mut mem = self.mem();
        let mut codes = [0u8; INDEXER_HEAD_DIM];
        for token in 0..p.num_tokens {
            let slot = mem.i64_at(p.slots + 8 * token)?;
            if slot < 0 {
                continue;
            }
            if slot as u64 >= p.dst_pages * PAGE_SIZE as u64 {
                report(&mut mem, &p.status, token)?;
                continue;
            }
            let keys = bf16s(mem.bytes(p.src + token * p.src_stride, 2 * INDEXER_HEAD_DIM)?);
            let scale = fp8::quantize_indexer_row(&keys, kind, &mut codes);
            let block = p.dst + (slot as u64 / PAGE_SIZE as u64) * INDEXER_PAGE_BYTES as u64;
            let offset = slot as u64 % PAGE_SIZE as u64;
            mem.bytes_mut(block + offset * INDEXER_HEAD_DIM as u64, INDEXER_HEAD_DIM)?
                .copy_from_slice(&codes);
            mem.bytes_mut(block + INDEXER_SCALES_OFFSET as u64 + 4 * offset, 4)?
                .copy_from_slice(&scale.to_le_bytes());
        }
        Ok(())
    }

    unsafe fn resolve(&self, mut p: abi::kvs_resolve_params) -> Result<()> {
        check::resolve(&p)?;
        p.status = self.begin(super::resolve_kernel(&p).name());
        let placement = Placement::new(p.shard)?;
        let mut mem = self.mem();
        let mut count = 0u64;
        for i in 0..p.num_entries {
            let e = mem.i64_at(p.entries + 8 * i)?;
            if e < 0 {
                continue;
            }
            let e = e as u64;
            if e >= p.limit {
                report(&mut mem, &p.status, i)?;
                continue;
            }
            let owned = if p.mode == abi::KVS_RESOLVE_TOKENS {
                (placement.slot_owner(e) == p.rank).then(|| placement.local_row(e))
            } else {
                (placement.owner(e) == p.rank).then(|| placement.local_page(e))
            };
            if let Some(local) = owned {
                mem.bytes_mut(p.out_positions + 4 * count, 4)?
                    .copy_from_slice(&(i as i32).to_le_bytes());
                mem.bytes_mut(p.out_local + 8 * count, 8)?
                    .copy_from_slice(&(local as i64).to_le_bytes());
                count += 1;
            }
        }
        if p.num_entries > 0 {
            mem.set_u64(p.out_count, count)?;
        }
        Ok(())
    }

    unsafe fn scratch_rows(&self, mut p: abi::kvs_scratch_rows_params) -> Result<()> {
        p.status = self.begin("kvs_scratch_rows");
        let mut mem = self.mem();
        let page_size = PAGE_SIZE as u64;
        for i in 0..p.num_slots {
            let slot = mem.i64_at(p.slots + 8 * i)?;
            let mut row = -1i64;
            if slot >= 0 {
                let page = slot as u64 / page_size;
                let scratch_page = if page < p.table_len {
                    mem.i64_at(p.page_table + 8 * page)?
                } else {
                    -1
                };
                // Bound the page before multiplying, so a huge table entry cannot wrap into range.
                let mapped =
                    scratch_page >= 0 && (scratch_page as u64) < p.scratch_rows.div_ceil(page_size);
                let candidate = if mapped {
                    scratch_page as u64 * page_size + slot as u64 % page_size
                } else {
                    p.scratch_rows
                };
                if candidate < p.scratch_rows {
                    row = candidate as i64;
                } else {
                    report(&mut mem, &p.status, i)?;
                }
            }
            mem.bytes_mut(p.out_rows + 8 * i, 8)?
                .copy_from_slice(&row.to_le_bytes());
        }
        Ok(())
    }

    unsafe fn copy_blocks(&self, mut p: abi::kvs_copy_blocks_params, launch: Launch) -> Result<()> {
        check::copy_blocks(&p)?;
        launch.validate(1024)?;
        p.status = self.begin("kvs_copy_blocks");
        let mut mem = self.mem();
        let pairs = mem.pairs(p.pairs, p.num_pairs)?;
        for (k, pair) in pairs.iter().enumerate() {
            for j in 0..p.num_pages {
                let src_page = resolve_page(&mut mem, &p.src_pages, j, &p.status)?;
                let dst_page = resolve_page(&mut mem, &p.dst_pages, j, &p.status)?;
                let component_ok = pair.component < p.num_components;
                if !component_ok && j == 0 {
                    report(&mut mem, &p.status, k as u64 * p.num_pages)?;
                }
                if let (Some(s), Some(d), true) = (src_page, dst_page, component_ok) {
                    let c = &p.components[pair.component as usize];
                    let src = pair.src + s * c.src.page_stride;
                    let dst = pair.dst + d * c.dst.page_stride;
                    for r in 0..u64::from(c.rows) {
                        mem.copy(
                            dst + r * c.dst.row_stride,
                            src + r * c.src.row_stride,
                            c.row_bytes as usize,
                        )?;
                    }
                }
                if p.signals != 0 {
                    let at = p.signals + 4 * u64::from(pair.signal);
                    let counter = mem.bytes_mut(at, 4)?;
                    let v = u32::from_le_bytes((&*counter).try_into().expect("4 bytes"))
                        .wrapping_add(1);
                    counter.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    unsafe fn write_rows(&self, mut p: abi::kvs_write_rows_params, launch: Launch) -> Result<()> {
        check::write_rows(&p)?;
        launch.validate(512)?;
        p.status = self.begin("kvs_write_rows");
        let placement = Placement::new(p.shard)?;
        let mut mem = self.mem();
        let mut rows = Vec::with_capacity(p.num_slots as usize);
        for i in 0..p.num_slots {
            let slot = mem.i64_at(p.slots + 8 * i)?;
            let mut target = None;
            if slot >= 0 {
                let slot = slot as u64;
                let owned = slot < p.slot_limit && placement.slot_owner(slot) == p.rank;
                let row = placement.local_row(slot);
                if slot >= p.slot_limit || (owned && row >= p.dst_rows) {
                    report(&mut mem, &p.status, i)?;
                } else if owned {
                    target = Some(row);
                }
            }
            rows.push(target);
        }
        let pairs = mem.pairs(p.pairs, p.num_pairs)?;
        for (k, pair) in pairs.iter().enumerate() {
            if pair.component >= p.num_components {
                report(&mut mem, &p.status, p.num_slots + k as u64)?;
                continue;
            }
            let c = p.components[pair.component as usize];
            for (token, row) in rows.iter().enumerate() {
                let Some(row) = *row else { continue };
                let token = token as u64;
                if c.kind == abi::KVS_ROWS_INDEXER {
                    let (page, block) = (PAGE_SIZE as u64, INDEXER_PAGE_BYTES as u64);
                    let src_block = pair.src + (token / page) * block;
                    let dst_block = pair.dst + (row / page) * block;
                    let key = INDEXER_HEAD_DIM as u64;
                    mem.copy(
                        dst_block + (row % page) * key,
                        src_block + (token % page) * key,
                        INDEXER_HEAD_DIM,
                    )?;
                    let scales = INDEXER_SCALES_OFFSET as u64;
                    mem.copy(
                        dst_block + scales + 4 * (row % page),
                        src_block + scales + 4 * (token % page),
                        4,
                    )?;
                } else {
                    let r = u64::from(c.row_bytes);
                    mem.copy(
                        pair.dst + row * r,
                        pair.src + token * r,
                        c.row_bytes as usize,
                    )?;
                }
            }
        }
        Ok(())
    }

    unsafe fn copy_ranges(&self, p: abi::kvs_copy_ranges_params, launch: Launch) -> Result<()> {
        launch.validate(1024)?;
        let mut mem = self.mem();
        for r in 0..p.num_ranges {
            let at = p.ranges + 24 * r;
            let (src, dst, bytes) = (mem.u64_at(at)?, mem.u64_at(at + 8)?, mem.u64_at(at + 16)?);
            mem.copy(dst, src, bytes as usize)?;
        }
        Ok(())
    }

    unsafe fn memcpy(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.mem().copy(dst, src, len)
    }

    unsafe fn memcpy_2d(&self, c: &Copy2d) -> Result<()> {
        let mut mem = self.mem();
        for row in 0..c.height {
            mem.copy(
                c.dst + row * c.dst_pitch,
                c.src + row * c.src_pitch,
                c.width as usize,
            )?;
        }
        Ok(())
    }

    unsafe fn memcpy_batch(&self, ranges: &[abi::kvs_range]) -> Result<()> {
        let mut mem = self.mem();
        for r in ranges {
            mem.copy(r.dst, r.src, r.bytes as usize)?;
        }
        Ok(())
    }
}
