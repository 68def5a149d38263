//! Copy-engine programs: page pairs between a device-side space (pages of packed blocks, one
//! buffer per stored layer) and a host-side space (any HiCache layout) turned into few, large
//! DMA copies: contiguous runs, 2D copies over layers where strides allow, and batch calls.
//! The program is plain data (a list of calls), enqueued by one function.
//!
//! Why (docs/design.md, "What measured fast"): the copy engine is fastest, and leaves compute
//! alone, with few large contiguous copies; per-block copies cost ~3.7 us of host time each.

use super::runs::Run;
use super::space::BlockSpace;
use crate::abi;
use crate::backend::{ordered_pages, Backend, Copy2d, Pages};
use crate::error::Result;
use crate::index::{LocalPage, ModelLayer};

/// Largest pitch a 2D copy may use (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`, 2^31 - 1 on every current
/// NVIDIA GPU): larger strides (the layer stride of a big `layer_first` host pool) are moved as
/// per-layer pieces instead.
pub(crate) const MAX_2D_PITCH: u64 = i32::MAX as u64;

/// Which way a transfer between the device side and the host side moves pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device (H2D).
    Load,
    /// Device to host (D2H).
    Backup,
}

impl Direction {
    /// The side read and the side written, of a device side and a host side (a space with the
    /// pages a copy touches there, as [`submit`] takes them).
    pub(crate) fn read_and_written<T>(self, device: T, host: T) -> (T, T) {
        match self {
            Direction::Load => (host, device),
            Direction::Backup => (device, host),
        }
    }
}

/// Which model layers a call moves (model layers number the target's layers, then the draft's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layers {
    /// Every component of every layer.
    All,
    /// Every component of one layer's readiness group: model layer `m`; target layer 0's group
    /// also holds the MTP draft's layer (SGLang loads the draft with layer 0, and an engine
    /// written against it reads the draft once layer 0 is ready), so the draft's own model
    /// layer names the same group.
    One(ModelLayer),
}

/// One contiguous or 2D stretch, in device-side / host-side terms (direction-free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub device: u64,
    pub device_pitch: u64,
    pub host: u64,
    pub host_pitch: u64,
    pub width: u64,
    pub height: u64,
}

impl Piece {
    pub(crate) fn contiguous(device: u64, host: u64, width: u64) -> Self {
        Self {
            device,
            device_pitch: width,
            host,
            host_pitch: width,
            width,
            height: 1,
        }
    }

    /// Folds rows that are back to back on both sides into one row.
    fn folded(mut self) -> Self {
        if self.height > 1 && self.device_pitch == self.width && self.host_pitch == self.width {
            self.width *= self.height;
            self.height = 1;
            self.device_pitch = self.width;
            self.host_pitch = self.width;
        }
        self
    }

    fn copy(&self, direction: Direction) -> Copy2d {
        let (dst, dst_pitch, src, src_pitch) = match direction {
            Direction::Load => (self.device, self.device_pitch, self.host, self.host_pitch),
            Direction::Backup => (self.host, self.host_pitch, self.device, self.device_pitch),
        };
        Copy2d {
            dst,
            dst_pitch,
            src,
            src_pitch,
            width: self.width,
            height: self.height,
        }
    }

    fn range(&self, direction: Direction) -> abi::kvs_range {
        let c = self.copy(direction);
        abi::kvs_range {
            src: c.src,
            dst: c.dst,
            bytes: c.width,
        }
    }

    /// The call moving this piece: a plain copy, a 2D copy, or per-row copies when a pitch is
    /// beyond what a 2D copy takes.
    pub(crate) fn calls(self, direction: Direction) -> Vec<Call> {
        if self.height == 1 {
            return vec![Call::Memcpy(self.copy(direction))];
        }
        if self.device_pitch > MAX_2D_PITCH || self.host_pitch > MAX_2D_PITCH {
            return (0..self.height)
                .map(|r| {
                    Call::Memcpy(
                        Piece::contiguous(
                            self.device + r * self.device_pitch,
                            self.host + r * self.host_pitch,
                            self.width,
                        )
                        .copy(direction),
                    )
                })
                .collect();
        }
        vec![Call::Memcpy2d(self.copy(direction))]
    }
}

/// One copy-engine call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    Memcpy(Copy2d),
    Memcpy2d(Copy2d),
    Batch(Vec<abi::kvs_range>),
}

/// What a program submits, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct IoCalls {
    /// `kvs_copy_blocks` launches.
    pub launches: usize,
    /// One-dimensional copy-engine copies.
    pub memcpy: usize,
    /// 2D copy-engine copies.
    pub memcpy_2d: usize,
    /// Batch calls.
    pub batch_calls: usize,
    /// Entries over every batch call.
    pub batch_entries: usize,
}

impl IoCalls {
    pub(crate) fn count(calls: &[Call]) -> Self {
        let mut n = Self::default();
        for call in calls {
            match call {
                Call::Memcpy(_) => n.memcpy += 1,
                Call::Memcpy2d(_) => n.memcpy_2d += 1,
                Call::Batch(entries) => {
                    n.batch_calls += 1;
                    n.batch_entries += entries.len();
                }
            }
        }
        n
    }
}

/// Enqueues `calls` on `backend`, ordered after conflicting work of other streams on the pages
/// they read (`from`, with its pages) and write (`to`, with its pages), whose usages then keep
/// the memory until they have run; work of another stream on other pages is not waited for.
///
/// # Safety
/// Every piece must read inside memory `from` tracks and write inside memory `to` tracks, in
/// `backend`'s address space, each inside the pages given for its memory.
pub(crate) unsafe fn submit(
    backend: &dyn Backend,
    calls: Vec<Call>,
    (from, from_pages): (&dyn BlockSpace, &Pages),
    (to, to_pages): (&dyn BlockSpace, &Pages),
) -> Result<()> {
    ordered_pages(
        backend,
        &[(from.usage(), from_pages)],
        &[(to.usage(), to_pages)],
        || {
            for call in calls {
                // SAFETY: the caller's contract covers every call.
                unsafe {
                    match call {
                        Call::Memcpy(c) => backend.memcpy(c.dst, c.src, c.width as usize)?,
                        Call::Memcpy2d(c) => backend.memcpy_2d(&c)?,
                        Call::Batch(ranges) => backend.memcpy_batch(&ranges)?,
                    }
                }
            }
            Ok(())
        },
    )
}

/// The device and host sides of a HiCache-shaped transfer, with the pages it moves: `runs`
/// coalesced (device, host) runs, or the same pairs one by one in `pairs`. Every page was
/// checked against both spaces, and both spaces hold the same components.
pub(crate) struct Sides<'a> {
    pub device: &'a dyn BlockSpace,
    pub host: &'a dyn BlockSpace,
    pub runs: &'a [Run],
    pub device_pages: &'a [LocalPage],
    pub host_pages: &'a [LocalPage],
}

impl Sides<'_> {
    /// Stored layers of component index `c` whose model layer `select` accepts.
    fn stored_layers(&self, c: usize, select: &dyn Fn(ModelLayer) -> bool) -> Vec<usize> {
        let model = &self.device.components()[c].model_layers;
        (0..model.len()).filter(|&l| select(model[l])).collect()
    }

    /// Few, large pieces: runs coalesced, and all layers of a run stacked into one 2D copy
    /// where the device layer stride is uniform and every pitch is one a 2D copy accepts.
    /// Contiguous pieces go to the driver as one batch; 2D pieces one call each.
    pub(crate) fn coalesced(
        &self,
        select: &dyn Fn(ModelLayer) -> bool,
        direction: Direction,
    ) -> Vec<Call> {
        let mut pieces = Vec::new();
        for (c, comp) in self.device.components().iter().enumerate() {
            let selected = self.stored_layers(c, select);
            let s = self.host.side(c);
            let host_layer_stride = self.host.layer_stride(c).unwrap_or(0);
            let block = comp.block_bytes as u64;
            let all_layers = selected.len() == comp.layers() && comp.layers() > 1;
            let stack_pitch = self
                .device
                .layer_stride(c)
                .filter(|&stride| stride <= MAX_2D_PITCH && host_layer_stride <= MAX_2D_PITCH)
                .filter(|_| self.host.layer_stride(c).is_some());
            let rows_contiguous = comp.rows == 1 || s.row_stride == comp.row_bytes as u64;
            let height = comp.layers() as u64;
            for run in self.runs {
                let dev = |l: usize, page: u64| self.device.base(c, l) + page * block;
                let host = |l: usize, page: u64| self.host.base(c, l) + page * s.page_stride;
                let (d0, h0) = (run.src.0, run.dst.0);
                match (rows_contiguous, s.page_stride == block, stack_pitch) {
                    // layer_first: the run's pages are contiguous in each layer.
                    (true, true, Some(pitch)) if all_layers => pieces.push(Piece {
                        device: dev(0, d0),
                        device_pitch: pitch,
                        host: host(0, h0),
                        host_pitch: host_layer_stride,
                        width: run.pages * block,
                        height,
                    }),
                    (true, true, _) => {
                        pieces.extend(selected.iter().map(|&l| {
                            Piece::contiguous(dev(l, d0), host(l, h0), run.pages * block)
                        }))
                    }
                    // Page-major blocks: a page of every layer is contiguous on the host.
                    (true, false, Some(pitch)) if all_layers && run.pages <= height => pieces
                        .extend((0..run.pages).map(|j| Piece {
                            device: dev(0, d0 + j),
                            device_pitch: pitch,
                            host: host(0, h0 + j),
                            host_pitch: host_layer_stride,
                            width: block,
                            height,
                        })),
                    (true, false, _) => pieces.extend(selected.iter().map(|&l| {
                        Piece {
                            device: dev(l, d0),
                            device_pitch: block,
                            host: host(l, h0),
                            host_pitch: s.page_stride,
                            width: block,
                            height: run.pages,
                        }
                        .folded()
                    })),
                    // Token-major rows: one 2D copy of the run's rows per layer.
                    (false, _, _) => pieces.extend(selected.iter().map(|&l| Piece {
                        device: dev(l, d0),
                        device_pitch: comp.row_bytes as u64,
                        host: host(l, h0),
                        host_pitch: s.row_stride,
                        width: comp.row_bytes as u64,
                        height: run.pages * comp.rows as u64,
                    })),
                }
            }
        }
        let (flat, strided): (Vec<Piece>, Vec<Piece>) =
            pieces.into_iter().partition(|p| p.height == 1);
        let mut calls: Vec<Call> = strided
            .into_iter()
            .flat_map(|p| p.calls(direction))
            .collect();
        match flat.as_slice() {
            [] => {}
            [one] => calls.push(Call::Memcpy(one.copy(direction))),
            many => calls.push(Call::Batch(
                many.iter().map(|p| p.range(direction)).collect(),
            )),
        }
        calls
    }

    /// One piece per (page, layer, component) block, layer by layer; a token-major block is a
    /// 2D piece of its rows, or (`split_rows`) one piece per row: the per-block baselines.
    fn block_pieces(&self, select: &dyn Fn(ModelLayer) -> bool, split_rows: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        let components = self.device.components();
        let per_component: Vec<Vec<usize>> = (0..components.len())
            .map(|c| self.stored_layers(c, select))
            .collect();
        let model_layers = components
            .iter()
            .flat_map(|c| c.model_layers.iter().map(|m| m.0 + 1))
            .max()
            .unwrap_or(0);
        for m in 0..model_layers {
            for (c, comp) in components.iter().enumerate() {
                let Some(&l) = per_component[c]
                    .iter()
                    .find(|&&l| comp.model_layers[l].0 == m)
                else {
                    continue;
                };
                let s = self.host.side(c);
                let block = comp.block_bytes as u64;
                let row = comp.row_bytes as u64;
                let rows_contiguous = comp.rows == 1 || s.row_stride == row;
                for (dp, hp) in self.device_pages.iter().zip(self.host_pages) {
                    let dev = self.device.base(c, l) + dp.0 * block;
                    let host = self.host.base(c, l) + hp.0 * s.page_stride;
                    if rows_contiguous {
                        out.push(Piece::contiguous(dev, host, block));
                    } else if split_rows {
                        out.extend((0..comp.rows as u64).map(|r| {
                            Piece::contiguous(dev + r * row, host + r * s.row_stride, row)
                        }));
                    } else {
                        out.push(Piece {
                            device: dev,
                            device_pitch: row,
                            host,
                            host_pitch: s.row_stride,
                            width: row,
                            height: comp.rows as u64,
                        });
                    }
                }
            }
        }
        out
    }

    /// One copy-engine call per block (a 2D copy of its rows for token-major latent blocks).
    pub(crate) fn per_block(
        &self,
        select: &dyn Fn(ModelLayer) -> bool,
        direction: Direction,
    ) -> Vec<Call> {
        self.block_pieces(select, false)
            .into_iter()
            .flat_map(|p| p.calls(direction))
            .collect()
    }

    /// One batch call holding every block (every row of token-major latent blocks).
    pub(crate) fn batch(
        &self,
        select: &dyn Fn(ModelLayer) -> bool,
        direction: Direction,
    ) -> Vec<Call> {
        let pieces = self.block_pieces(select, true);
        if pieces.is_empty() {
            return Vec::new();
        }
        vec![Call::Batch(
            pieces.iter().map(|p| p.range(direction)).collect(),
        )]
    }
}
