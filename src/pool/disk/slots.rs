//! Slot math: the direct-I/O alignment of a directory (`statx` `STATX_DIOALIGN`, 4 KiB when the
//! kernel or filesystem does not say), the canonical byte order of one page in a slot, and the
//! runs of adjacent slots one descriptor covers.

use std::path::Path;

use crate::copy::BlockSpace;
use crate::error::{Error, Result, StorageFailure};
use crate::index::{LocalPage, StoredLayer};
use crate::pool::host::HostPool;

/// The alignment used where `statx` does not report one (kernels before 6.1, filesystems
/// without direct I/O information): 4 KiB satisfies every common block device.
pub(super) const DEFAULT_ALIGN: u64 = 4096;

/// Direct-I/O alignment of the store's files: (memory alignment, file offset and length
/// alignment), from `statx` `STATX_DIOALIGN` on `probe` (an open file of the store's
/// directory), each at least 512 B and a power of two, [`DEFAULT_ALIGN`] where not reported.
pub(super) fn dio_align(probe: std::os::fd::BorrowedFd<'_>) -> (u64, u64) {
    use rustix::fs::{statx, AtFlags, StatxFlags};
    let reported = statx(probe, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN)
        .ok()
        .filter(|s| StatxFlags::from_bits_retain(s.stx_mask).contains(StatxFlags::DIOALIGN));
    let pick = |v: u32| {
        let v = u64::from(v);
        if v == 0 || !v.is_power_of_two() {
            DEFAULT_ALIGN
        } else {
            v.max(512)
        }
    };
    match reported {
        Some(s) => (pick(s.stx_dio_mem_align), pick(s.stx_dio_offset_align)),
        None => (DEFAULT_ALIGN, DEFAULT_ALIGN),
    }
}

/// One contiguous piece of a host page: `bytes` at `offset + page * page_stride` of host
/// buffer `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    buffer: usize,
    offset: u64,
    page_stride: u64,
    bytes: usize,
}

/// Where a page's bytes go in a slot: every component in [`Component::ALL`](crate::geometry::Component::ALL)
/// order, every stored layer in order, every block's rows in order (the same bytes whatever the
/// host pool's format, so ranks with different host layouts share slots), then zeros up to the
/// slot size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotLayout {
    pieces: Vec<Piece>,
    page_bytes: u64,
    slot_bytes: u64,
}

impl SlotLayout {
    /// The layout of pages of `host` in slots aligned to `align` bytes.
    pub fn new(host: &HostPool, align: u64) -> Result<Self> {
        let mut pieces: Vec<Piece> = Vec::new();
        let mut page_bytes = 0u64;
        for comp in host.components() {
            let (buffer, _) = host.component_buffer(comp.component)?;
            let stride = host.strides(comp.component)?.page_stride;
            for l in 0..comp.layers() {
                for r in 0..comp.rows {
                    let offset =
                        host.row_offset(comp.component, StoredLayer(l), LocalPage(0), r)?;
                    // Rows that follow one another in the buffer are one piece.
                    match pieces.last_mut() {
                        Some(p) if p.buffer == buffer && p.offset + p.bytes as u64 == offset => {
                            p.bytes += comp.row_bytes;
                        }
                        _ => pieces.push(Piece {
                            buffer,
                            offset,
                            page_stride: stride,
                            bytes: comp.row_bytes,
                        }),
                    }
                    page_bytes += comp.row_bytes as u64;
                }
            }
        }
        let slot_bytes = page_bytes
            .div_ceil(align)
            .checked_mul(align)
            .ok_or_else(|| {
                Error::overflow(format!("a slot of {page_bytes} B aligned to {align} B"))
            })?;
        Ok(Self {
            pieces,
            page_bytes,
            slot_bytes,
        })
    }

    /// Bytes of one page's data.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Bytes of one slot (the page, padded to the alignment).
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Copies host page `page` into `slot` (the page's bytes in slot order; the padding is
    /// zeroed) and returns the CRC-32C of the page's bytes continued from `crc`, each piece
    /// checksummed right after its copy, while it is in cache.
    ///
    /// # Safety
    /// `bases[b]` must be the process address of host buffer `b` of the pool this layout was
    /// made for, valid for reads of the whole buffer, and no transfer may write the page while
    /// it is copied.
    pub unsafe fn pack(&self, bases: &[usize], page: LocalPage, slot: &mut [u8], crc: u32) -> u32 {
        let mut at = 0usize;
        let mut crc = crc;
        for p in &self.pieces {
            let src = bases[p.buffer] + (p.offset + page.0 * p.page_stride) as usize;
            // SAFETY: the caller vouches for the buffer; `page` was checked against the pool's
            // pages by `check_page`, so the piece lies inside the buffer; `slot` holds
            // `slot_bytes >= page_bytes` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src as *const u8,
                    slot[at..at + p.bytes].as_mut_ptr(),
                    p.bytes,
                )
            };
            crc = crc32c::crc32c_append(crc, &slot[at..at + p.bytes]);
            at += p.bytes;
        }
        slot[at..].fill(0);
        crc
    }

    /// Copies `slot`'s page bytes into host page `page`.
    ///
    /// # Safety
    /// As [`SlotLayout::pack`], with the buffers valid for writes and no transfer reading or
    /// writing the page meanwhile.
    pub unsafe fn unpack(&self, bases: &[usize], slot: &[u8], page: LocalPage) {
        let mut at = 0usize;
        for p in &self.pieces {
            let dst = bases[p.buffer] + (p.offset + page.0 * p.page_stride) as usize;
            // SAFETY: as in `pack`, with the buffer writable.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    slot[at..at + p.bytes].as_ptr(),
                    dst as *mut u8,
                    p.bytes,
                )
            };
            at += p.bytes;
        }
    }
}

/// Checks `page` is a usable page of `host` (page 0 is the padding page).
pub(super) fn check_page(host: &HostPool, page: LocalPage) -> Result<()> {
    if page.0 == 0 || page.0 >= host.pages() {
        return Err(Error::OutOfRange {
            what: "host page (1..pages)",
            index: i64::try_from(page.0).unwrap_or(i64::MAX),
            limit: host.pages(),
        });
    }
    Ok(())
}

/// Runs of consecutive slots in `slots` (sorted), each at most `max_slots` long: what one
/// descriptor covers. Returns (first slot, count, index of the run's first element in `slots`).
pub(super) fn runs(slots: &[u64], max_slots: u64) -> Vec<(u64, u64, usize)> {
    let mut out: Vec<(u64, u64, usize)> = Vec::new();
    for (i, &s) in slots.iter().enumerate() {
        match out.last_mut() {
            Some((first, n, _)) if *first + *n == s && *n < max_slots => *n += 1,
            _ => out.push((s, 1, i)),
        }
    }
    out
}

/// A storage error about `path`.
pub(super) fn storage(
    path: &Path,
    failure: StorageFailure,
    reason: impl std::fmt::Display,
) -> Error {
    Error::Storage {
        path: path.display().to_string(),
        failure,
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
    use crate::pool::host::{HostFormat, HostLayout};

    #[test]
    fn runs_coalesce_adjacent_slots_up_to_the_cap() {
        assert_eq!(
            runs(&[1, 2, 3, 5, 6, 9], 8),
            vec![(1, 3, 0), (5, 2, 3), (9, 1, 5)]
        );
        assert_eq!(
            runs(&[1, 2, 3, 4, 5], 2),
            vec![(1, 2, 0), (3, 2, 2), (5, 1, 4)]
        );
        assert!(runs(&[], 4).is_empty());
    }

    #[test]
    fn slots_hold_every_component_in_one_order_whatever_the_host_layout() {
        let b = CpuBackend::new();
        let g = CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Scaled,
            vec![true, false, true],
        ));
        for layout in HostLayout::ALL {
            for format in [
                HostFormat::kvshard(layout),
                HostFormat::sglang(layout, true),
            ] {
                let host = HostPool::new_with(&b, &g, 4, format).unwrap();
                let s = SlotLayout::new(&host, 4096).unwrap();
                assert_eq!(s.page_bytes(), g.page_bytes() as u64);
                assert_eq!(s.slot_bytes() % 4096, 0);
                assert!(s.slot_bytes() - s.page_bytes() < 4096);
                // Host bytes numbered by their canonical position (a snapshot): packing page 2
                // must give that page's canonical bytes.
                let bases: Vec<usize> = (0..host.buffer_layouts().len())
                    .map(|i| {
                        let m = host.buffer_memory(i).unwrap();
                        b.host_address(m.addr(), m.len()).unwrap()
                    })
                    .collect();
                for (i, &base) in bases.iter().enumerate() {
                    let len = host.buffer_memory(i).unwrap().len();
                    // SAFETY: the arena allocation of buffer i, len bytes, unused elsewhere.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len) };
                    for (k, x) in bytes.iter_mut().enumerate() {
                        *x = (k * 7 + i * 13 + k / 251) as u8;
                    }
                }
                let snap = host.snapshot_sync(&b).unwrap();
                let mut slot = vec![0xAAu8; s.slot_bytes() as usize];
                // SAFETY: bases are the pool's buffers; page 2 < 4 pages.
                let crc = unsafe { s.pack(&bases, LocalPage(2), &mut slot, 0) };
                assert_eq!(crc, crc32c::crc32c(&slot[..s.page_bytes() as usize]));
                assert!(slot[s.page_bytes() as usize..].iter().all(|&x| x == 0));
                // The canonical snapshot is component, layer, page, rows: gather page 2 from it.
                let mut expected = Vec::new();
                let mut at = 0usize;
                for comp in host.components() {
                    let block = comp.rows * comp.row_bytes;
                    for _ in 0..comp.layers() {
                        expected.extend_from_slice(&snap[at + 2 * block..at + 3 * block]);
                        at += 4 * block;
                    }
                }
                assert_eq!(&slot[..s.page_bytes() as usize], &expected[..], "{format}");
                // Unpacking into page 3 makes page 3 a copy of page 2.
                // SAFETY: as above.
                unsafe { s.unpack(&bases, &slot, LocalPage(3)) };
                let mut again = vec![0u8; s.slot_bytes() as usize];
                // SAFETY: as above.
                unsafe { s.pack(&bases, LocalPage(3), &mut again, 0) };
                assert_eq!(again, slot);
            }
        }
        assert!(check_page(
            &HostPool::new_with(&b, &g, 4, HostLayout::LayerFirst.into()).unwrap(),
            LocalPage(0)
        )
        .is_err());
    }
}
