//! Owner-local resolution (issue 3): `kvs_resolve` from 1K to 4M entries next to an empty
//! kernel launch, a kernel that only reads the entries, and the byte floor: bytes read + written
//! over the in-run device copy bandwidth, and (stricter) over the copy's read+write rate.

use kvshard::backend::{i64s_from_bytes, upload_i64s_sync, Backend, MemoryKind};
use kvshard::copy::Resolver;
use kvshard::gpu::bench;
use kvshard::shard::{resolve_owned, Placement, ResolveMode};
use kvshard::{Error, Result};
use rand::Rng;

use crate::harness::{Ctx, Report};

/// Physical pages per rank of the resolved group: entries are token slots below the group's
/// logical capacity, `N x 2^16` pages.
const PAGES_PER_RANK: u64 = 1 << 16;

pub fn run(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let empty = ctx.time(ctx.reps(50), || {
        bench::empty_kernel(&ctx.gpu, ctx.backend.stream())
    })?;
    report.add(
        "resolve",
        "empty kernel launch (event to event)".into(),
        0,
        empty,
        ("d2d r+w", 2.0 * ctx.ceilings.d2d),
        String::new(),
    );
    let sink = ctx.backend.alloc(8, MemoryKind::Device)?;
    for n in [1usize << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22] {
        for shard in [1u32, 4, 8] {
            let placement = Placement::new(shard)?;
            // Token slots of a group of 2^16 pages per rank; about one in ten is padding.
            let limit = placement.logical_capacity(PAGES_PER_RANK)?;
            let entries: Vec<i64> = (0..n)
                .map(|_| {
                    if ctx.rng.random_range(0..10) == 0 {
                        -1
                    } else {
                        ctx.rng.random_range(0..limit as i64)
                    }
                })
                .collect();
            let input = upload_i64s_sync(ctx.backend.as_ref(), &entries)?;
            let read = ctx.time(ctx.reps(30), || {
                // SAFETY: `input` holds 8n bytes and `sink` 8, both live device buffers of this
                // GPU that outlive the timing (which synchronizes every repeat).
                unsafe {
                    bench::read(
                        &ctx.gpu,
                        ctx.backend.stream(),
                        input.addr(),
                        8 * n as u64,
                        sink.addr(),
                    )
                }
            })?;
            let mut resolver = Resolver::new(ctx.backend.as_ref(), n)?;
            let stats = ctx.time(ctx.reps(30), || {
                // SAFETY: `input` holds n int64 entries of this backend and outlives every
                // launch; the resolver was made on this backend and every launch is on its one
                // stream, so launches never overlap.
                unsafe {
                    resolver.resolve_device(
                        ctx.backend.as_ref(),
                        input.addr(),
                        n,
                        placement,
                        0,
                        ResolveMode::Tokens,
                        limit,
                    )
                }
            })?;
            ctx.backend.synchronize()?;
            let expected = resolve_owned(placement, 0, ResolveMode::Tokens, &entries, limit)?;
            let count = u64::from_le_bytes(
                ctx.backend
                    .read_sync(resolver.count_buffer(), 0, 8)?
                    .try_into()
                    .map_err(|_| Error::InvalidArgument("resolve count read back short".into()))?,
            ) as usize;
            if count != expected.local.len() {
                return Err(Error::InvalidArgument(format!(
                    "resolve of {n} entries (N={shard}) counted {count} owned, the reference {}",
                    expected.local.len()
                )));
            }
            let local = i64s_from_bytes(&ctx.backend.read_sync(resolver.local(), 0, 8 * count)?);
            let positions: Vec<u32> = ctx
                .backend
                .read_sync(resolver.positions(), 0, 4 * count)?
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if positions != expected.positions
                || local
                    .iter()
                    .zip(&expected.local)
                    .any(|(a, b)| *a as u64 != *b)
            {
                return Err(Error::InvalidArgument(format!(
                    "resolve of {n} entries (N={shard}) disagrees with the reference"
                )));
            }
            let bytes = 8 * n as u64 + 12 * count as u64;
            // The bound: bytes over the copy bandwidth, or the empty launch if larger.
            let floor = bytes as f64 / (ctx.ceilings.d2d * 1e6);
            let bound = floor.max(empty.median);
            let strict = (bytes as f64 / (2.0 * ctx.ceilings.d2d * 1e6)).max(empty.median);
            report.add(
                "resolve",
                format!("{n} token slots, N={shard}, rank 0 ({count} owned)"),
                bytes,
                stats,
                ("d2d r+w", 2.0 * ctx.ceilings.d2d),
                format!(
                    "{:.2}x max(floor {floor:.4} ms, empty launch {:.4} ms); {:.2}x at the r+w rate; {:.2}x a read of the entries ({:.4} ms)",
                    stats.median / bound,
                    empty.median,
                    stats.median / strict,
                    stats.median / read.median,
                    read.median,
                ),
            );
        }
    }
    Ok(())
}
