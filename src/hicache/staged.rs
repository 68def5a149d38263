//! The staged pipeline: a HiCache transfer through device staging. The copy engine moves host
//! runs of up to a chunk of pages between the host pool and a device mirror laid out exactly
//! like it (few, large contiguous copies: what the copy engine is fastest at and what leaves
//! compute alone), and a relayout places or gathers the scattered device pages between the
//! mirror and the device pool. Two mirrors are used in turn so the two halves overlap.
//!
//! Both relayout [`Method`]s serve every host layout and every device pool: [`Method::Kernel`]
//! is one `kvs_copy_blocks` launch per segment; [`Method::CopyEngine`] uses no SM, stacking a
//! page's layers into one 2D copy where the device layer stride is uniform and the blocks are
//! whole, and falling back to a copy per layer (engine buffers at arbitrary addresses) or a 2D
//! copy of a block's rows (token-major `page_first`) where they are not.

use std::sync::Arc;

use super::direct::{take_fit, HostTransfer};
use crate::backend::{Backend, Event, Pages};
use crate::copy::dma::{self, Call, Piece};
use crate::copy::space::sealed::Sealed as _;
use crate::copy::{
    BlockCopy, BlockCopyPlan, BlockSpace, Direction, Method, PageSelection, SpaceId, TableBuffer,
};
use crate::error::{Error, Result};
use crate::index::LocalPage;
use crate::pool::host::{HostLayout, HostPool};

/// Refuses, before anything is enqueued, a relayout method [`HostTransfer::run_staged`] cannot
/// run: anything but the block kernel and the copy engine, or a kernel launch shape no copy
/// kernel takes.
pub(crate) fn check_relayout(method: Method) -> Result<()> {
    match method {
        Method::Kernel(launch) => launch.validate(crate::abi::KVS_COPY_THREADS),
        Method::CopyEngine => Ok(()),
        Method::RangeKernel(_) | Method::BatchedCopyEngine | Method::PerBlock => {
            Err(Error::UnsupportedMethod {
                method: method.to_string(),
                route: "the relayout of a staged HiCache transfer",
                accepts: "Kernel or CopyEngine",
            })
        }
    }
}

/// Device staging for [`HostTransfer::run_staged`]: two device mirrors laid out like the host
/// pool, `chunk` pages each.
#[derive(Debug)]
pub struct StagedIo {
    /// The device pool, host pool and direction the staging serves.
    made_for: (SpaceId, SpaceId, Direction),
    layout: HostLayout,
    chunk: u64,
    mirrors: [Arc<HostPool>; 2],
}

impl StagedIo {
    /// Allocates staging for transfers in `direction` between the device pool `device` and
    /// `host`: two device mirrors of `host`, `chunk` pages each, in `backend`'s device memory.
    pub(crate) fn between(
        backend: &dyn Backend,
        device: SpaceId,
        host: &Arc<HostPool>,
        direction: Direction,
        chunk: u64,
    ) -> Result<Self> {
        if chunk == 0 {
            return Err(Error::InvalidArgument("staging of 0 pages".into()));
        }
        let mirrors = [
            Arc::new(HostPool::device_mirror(backend, host, chunk)?),
            Arc::new(HostPool::device_mirror(backend, host, chunk)?),
        ];
        Ok(Self {
            made_for: (device, host.id(), direction),
            layout: host.layout(),
            chunk,
            mirrors,
        })
    }

    /// Pages each staging buffer holds.
    pub fn chunk_pages(&self) -> u64 {
        self.chunk
    }

    /// Device bytes the two staging buffers take.
    pub fn bytes(&self) -> usize {
        self.mirrors.iter().map(|m| m.bytes()).sum()
    }

    /// The staging's identity (its first mirror's): what a prepared kernel relayout is tied to.
    pub fn id(&self) -> SpaceId {
        self.mirrors[0].id()
    }
}

/// A stretch of plan entries whose host pages are consecutive (one copy-engine run per
/// component on the host side); the device pages may be anything.
struct Segment {
    first_entry: usize,
    pages: u64,
    host_page: u64,
}

impl Segment {
    /// Its first `pages` pages and the rest (`0 < pages < self.pages`).
    fn split(&self, pages: u64) -> (Segment, Segment) {
        (
            Segment { pages, ..*self },
            Segment {
                first_entry: self.first_entry + pages as usize,
                pages: self.pages - pages,
                host_page: self.host_page + pages,
            },
        )
    }
}

/// Pages of the segment a staged transfer cannot overlap (a load's last relayout, a backup's
/// first): a quarter of a chunk. At 64 pages in chunks of 16 a load's unoverlapped relayout
/// shrinks from 45 MB to 11 MB for one more copy-engine copy and launch.
fn tail_pages(chunk: u64) -> u64 {
    chunk.div_ceil(4)
}

/// A plan's host pages, entry by entry, cut where host pages stop being consecutive or a
/// chunk is full, and the one segment whose relayout nothing overlaps cut down to
/// [`tail_pages`]: a load's last (its relayout runs after the last copy) and a backup's first
/// (the copy engine waits for its relayout).
fn segments(host_pages: &[LocalPage], chunk: u64, direction: Direction) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    for (j, &LocalPage(hp)) in host_pages.iter().enumerate() {
        match out.last_mut() {
            Some(s) if s.pages < chunk && s.host_page + s.pages == hp => s.pages += 1,
            _ => out.push(Segment {
                first_entry: j,
                pages: 1,
                host_page: hp,
            }),
        }
    }
    let tail = tail_pages(chunk);
    match direction {
        Direction::Load => {
            if let Some(last) = out.last_mut().filter(|s| s.pages > tail) {
                let (head, rest) = last.split(last.pages - tail);
                *last = head;
                out.push(rest);
            }
        }
        Direction::Backup => {
            if let Some(first) = out.first_mut().filter(|s| s.pages > tail) {
                let (head, rest) = first.split(tail);
                *first = rest;
                out.insert(0, head);
            }
        }
    }
    out
}

impl HostTransfer {
    /// Allocates the double-buffered device staging for [`HostTransfer::run_staged`], `chunk`
    /// pages per buffer, in `backend`'s device memory.
    pub fn staging(&self, backend: &dyn Backend, chunk: u64) -> Result<StagedIo> {
        StagedIo::between(backend, self.device.id(), &self.host, self.direction, chunk)
    }

    fn staging_key(&self) -> (SpaceId, SpaceId, Direction) {
        (self.device.id(), self.host.id(), self.direction)
    }

    fn check_staging(&self, staging: &StagedIo) -> Result<()> {
        if staging.made_for != self.staging_key() {
            let (_, _, direction) = staging.made_for;
            return Err(Error::HiCache(format!(
                "staging made for a {direction:?} between other pools ({} host) used for this {:?}",
                staging.layout, self.direction
            )));
        }
        Ok(())
    }

    /// The kernel relayout between mirror `m` and the device pool: mirror positions, the
    /// transfer's device pages, run a segment at a time.
    fn relayout_plan(&self, mirror: &HostPool) -> Result<BlockCopyPlan> {
        let device = PageSelection::Local(self.plan.device_pages().to_vec());
        let n = self.plan.len();
        match self.direction {
            Direction::Load => BlockCopyPlan::new(
                mirror,
                PageSelection::Positions,
                self.device.as_ref(),
                device,
                n,
            ),
            Direction::Backup => BlockCopyPlan::new(
                self.device.as_ref(),
                device,
                mirror,
                PageSelection::Positions,
                n,
            ),
        }
    }

    /// Uploads the kernel relayout's tables for `staging` through `backend`, waiting for the
    /// upload (use a stream other than the transfer's), taking buffers from `spare` where they
    /// fit.
    pub fn prepare_staged_sync(
        &mut self,
        backend: &dyn Backend,
        staging: &StagedIo,
        spare: &mut Vec<TableBuffer>,
    ) -> Result<()> {
        self.prepare_staged(backend, staging, spare)?;
        backend.synchronize()
    }

    /// [`HostTransfer::prepare_staged_sync`] without the wait: the uploads are enqueued on
    /// `backend`'s stream, and the relayouts on any stream are ordered after them; tables
    /// handed back while a run of the old ones is queued are rewritten only after it.
    pub fn prepare_staged(
        &mut self,
        backend: &dyn Backend,
        staging: &StagedIo,
        spare: &mut Vec<TableBuffer>,
    ) -> Result<()> {
        self.check_staging(staging)?;
        let id = staging.id();
        if self.plan.is_empty() || matches!(&self.relayout, Some((made, _)) if *made == id) {
            return Ok(());
        }
        // Prepared for another staging: its tables name the other mirrors; make them anew.
        if let Some((_, old)) = self.relayout.take() {
            spare.extend(old.into_iter().filter_map(BlockCopy::into_tables));
        }
        let mut copies = Vec::with_capacity(2);
        for mirror in &staging.mirrors {
            let plan = self.relayout_plan(mirror)?;
            let reuse = take_fit(spare, plan.table_bytes());
            let (mirror, device): (Arc<dyn BlockSpace>, Arc<dyn BlockSpace>) =
                (mirror.clone(), self.device.clone());
            let (src, dst) = match self.direction {
                Direction::Load => (mirror, device),
                Direction::Backup => (device, mirror),
            };
            copies.push(BlockCopy::prepare(backend, plan, src, dst, reuse)?);
        }
        self.relayout = Some((id, copies));
        Ok(())
    }

    /// Copy-engine copies of one segment between the host pool and a mirror: per component one
    /// contiguous run (page-major layouts) or one 2D copy over the layers (`layer_first`).
    fn mirror_copies(&self, seg: &Segment, mirror: &HostPool) -> Vec<Call> {
        let mut calls = Vec::new();
        for (c, comp) in self.device.components().iter().enumerate() {
            let host_side = self.host.side(c);
            let host_at = self.host.base(c, 0) + seg.host_page * host_side.page_stride;
            let mirror_at = mirror.base(c, 0);
            let piece = if self.host.layout() == HostLayout::LayerFirst {
                Piece {
                    device: mirror_at,
                    device_pitch: mirror.layer_stride(c).unwrap_or(0),
                    host: host_at,
                    host_pitch: self.host.layer_stride(c).unwrap_or(0),
                    width: seg.pages * comp.block_bytes as u64,
                    height: comp.layers() as u64,
                }
            } else {
                Piece::contiguous(mirror_at, host_at, seg.pages * comp.page_bytes() as u64)
            };
            calls.extend(piece.calls(self.direction));
        }
        calls
    }

    /// Copy-engine copies between a mirror and the device pool for one segment, per (page,
    /// component): the page's layers stacked into one 2D copy where the device stride is
    /// uniform and blocks are whole on the mirror, else a copy per layer (a 2D copy of the
    /// block's rows where the mirror is token-major).
    fn relayout_copies(&self, seg: &Segment, mirror: &HostPool) -> Vec<Call> {
        let mut calls = Vec::new();
        for (c, comp) in self.device.components().iter().enumerate() {
            let block = comp.block_bytes as u64;
            let m = mirror.side(c);
            let whole = comp.rows == 1 || m.row_stride == comp.row_bytes as u64;
            let stacked = crate::copy::space::sealed::Sealed::layer_stride(self.device.as_ref(), c)
                .filter(|_| whole && comp.layers() > 1);
            for j in 0..seg.pages {
                let dev_page = self.plan.device_pages()[seg.first_entry + j as usize].0;
                let device_at = |l: usize| self.device.base(c, l) + dev_page * block;
                let mirror_at = |l: usize| mirror.base(c, l) + j * m.page_stride;
                let pieces: Vec<Piece> = match stacked {
                    Some(pitch) => vec![Piece {
                        device: device_at(0),
                        device_pitch: pitch,
                        host: mirror_at(0),
                        host_pitch: mirror.layer_stride(c).unwrap_or(0),
                        width: block,
                        height: comp.layers() as u64,
                    }],
                    None if whole => (0..comp.layers())
                        .map(|l| Piece::contiguous(device_at(l), mirror_at(l), block))
                        .collect(),
                    None => (0..comp.layers())
                        .map(|l| Piece {
                            device: device_at(l),
                            device_pitch: comp.row_bytes as u64,
                            host: mirror_at(l),
                            host_pitch: m.row_stride,
                            width: comp.row_bytes as u64,
                            height: comp.rows as u64,
                        })
                        .collect(),
                };
                calls.extend(pieces.into_iter().flat_map(|p| p.calls(self.direction)));
            }
        }
        calls
    }

    /// Every layer through device staging: the copy engine moves host runs of up to
    /// `staging.chunk_pages()` pages as a few large contiguous copies on `copy`'s stream, and
    /// the relayout places or gathers the scattered device pages on `relayout`'s stream,
    /// double-buffered so that both overlap. Everything is ordered after what `copy`'s stream
    /// held when this was called, and when `copy`'s stream reaches the end of what this
    /// enqueues, the whole transfer has landed and `staging` may be reused. The relayout `how`
    /// is [`Method::Kernel`] (which needs [`HostTransfer::prepare_staged_sync`] first) or
    /// [`Method::CopyEngine`]; any other is [`Error::UnsupportedMethod`].
    pub fn run_staged(
        &self,
        copy: &dyn Backend,
        relayout: &dyn Backend,
        staging: &StagedIo,
        how: Method,
    ) -> Result<()> {
        check_relayout(how)?;
        self.check_staging(staging)?;
        self.check_backend(copy)?;
        self.check_backend(relayout)?;
        if self.plan.is_empty() {
            return Ok(());
        }
        let kernels = match how {
            Method::Kernel(launch) => Some((
                match &self.relayout {
                    Some((made, copies)) if *made == staging.id() => copies,
                    _ => {
                        return Err(Error::HiCache(
                            "a kernel relayout needs HostTransfer::prepare_staged_sync with this staging first"
                                .into(),
                        ))
                    }
                },
                launch,
            )),
            _ => None,
        };
        // The relayout stream starts after everything enqueued on `copy` so far: the caller's
        // ordering (a backup's compute event) and an earlier run through the same staging.
        relayout.wait(&copy.record()?)?;
        // Per staging buffer: the event after which it may be refilled.
        let mut free: [Option<Event>; 2] = [None, None];
        for (i, seg) in segments(self.plan.host_pages(), staging.chunk, self.direction)
            .iter()
            .enumerate()
        {
            let m = i % 2;
            let mirror = staging.mirrors[m].as_ref();
            // The pages of the two pools this segment touches: its usages order only those, so
            // a load and a backup of other pages run at once.
            let seg_device = Pages::of(
                self.plan.device_pages()[seg.first_entry..seg.first_entry + seg.pages as usize]
                    .iter()
                    .map(|p| p.0),
            );
            let seg_host = Pages::of(seg.host_page..seg.host_page + seg.pages);
            let all = Pages::All;
            let host_side = |copy: &dyn Backend| -> Result<()> {
                let (from, to) = self
                    .direction
                    .read_and_written::<(&dyn BlockSpace, &Pages)>(
                        (mirror, &all),
                        (self.host.as_ref(), &seg_host),
                    );
                // SAFETY (mirror copies): every piece lies inside the host pool (its consecutive
                // pages `seg.host_page..+seg.pages`, checked by the plan) and the mirror's first
                // `seg.pages` pages, in the copy stream's address space (checked above).
                unsafe { dma::submit(copy, self.mirror_copies(seg, mirror), from, to) }
            };
            let place = |stream: &dyn Backend| -> Result<()> {
                match &kernels {
                    Some((copies, launch)) => copies[m].run_entries(
                        stream,
                        seg.first_entry..seg.first_entry + seg.pages as usize,
                        *launch,
                    ),
                    // SAFETY: every piece lies inside the device pool (local pages the plan
                    // checked, in stored layers of each component) and the mirror (its first
                    // `seg.pages <= chunk` pages), both held by this transfer / the staging,
                    // in the stream's address space (checked above).
                    None => {
                        let (from, to) = self
                            .direction
                            .read_and_written::<(&dyn BlockSpace, &Pages)>(
                                (self.device.as_ref(), &seg_device),
                                (mirror, &all),
                            );
                        unsafe { dma::submit(stream, self.relayout_copies(seg, mirror), from, to) }
                    }
                }
            };
            match self.direction {
                Direction::Load => {
                    if let Some(e) = &free[m] {
                        copy.wait(e)?;
                    }
                    host_side(copy)?;
                    relayout.wait(&copy.record()?)?;
                    place(relayout)?;
                    free[m] = Some(relayout.record()?);
                }
                Direction::Backup => {
                    if let Some(e) = &free[m] {
                        relayout.wait(e)?;
                    }
                    place(relayout)?;
                    copy.wait(&relayout.record()?)?;
                    host_side(copy)?;
                    free[m] = Some(copy.record()?);
                }
            }
        }
        // Loads end on the relayout stream: make `copy` reach the end only after both buffers'
        // last relayouts (backups end on `copy` already).
        for event in free.iter().flatten() {
            copy.wait(event)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (first entry, pages, first host page) of each segment.
    fn cut(host_pages: &[u64], chunk: u64, direction: Direction) -> Vec<(usize, u64, u64)> {
        let host_pages: Vec<LocalPage> = host_pages.iter().copied().map(LocalPage).collect();
        segments(&host_pages, chunk, direction)
            .iter()
            .map(|s| (s.first_entry, s.pages, s.host_page))
            .collect()
    }

    #[test]
    fn a_loads_last_and_a_backups_first_segment_are_a_quarter_chunk() {
        let run: Vec<u64> = (100..164).collect();
        assert_eq!(
            cut(&run, 16, Direction::Load),
            [
                (0, 16, 100),
                (16, 16, 116),
                (32, 16, 132),
                (48, 12, 148),
                (60, 4, 160)
            ]
        );
        assert_eq!(
            cut(&run, 16, Direction::Backup),
            [
                (0, 4, 100),
                (4, 12, 104),
                (16, 16, 116),
                (32, 16, 132),
                (48, 16, 148)
            ]
        );
        // A segment no longer than the tail stays whole; chunk 1 has nothing to cut.
        assert_eq!(cut(&[7, 8, 9, 10], 16, Direction::Load), [(0, 4, 7)]);
        assert_eq!(
            cut(&[7, 8, 9], 1, Direction::Backup),
            [(0, 1, 7), (1, 1, 8), (2, 1, 9)]
        );
        assert!(cut(&[], 16, Direction::Load).is_empty());
    }

    #[test]
    fn segments_cover_every_entry_in_order_on_consecutive_host_pages() {
        let host = [3, 4, 5, 9, 10, 11, 12, 13, 14, 15, 2, 40, 41];
        for chunk in 1..=8 {
            for direction in [Direction::Load, Direction::Backup] {
                let mut next = 0;
                for (first_entry, pages, host_page) in cut(&host, chunk, direction) {
                    assert_eq!(first_entry, next, "chunk {chunk} {direction:?}");
                    assert!(pages >= 1 && pages <= chunk, "chunk {chunk} {direction:?}");
                    for k in 0..pages {
                        assert_eq!(host[next + k as usize], host_page + k);
                    }
                    next += pages as usize;
                }
                assert_eq!(next, host.len(), "chunk {chunk} {direction:?}");
            }
        }
    }
}
