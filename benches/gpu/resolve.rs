//! Owner-local index resolution (issue 3): `kvs_resolve` from 1K to 4M entries next to an empty
//! kernel launch, a kernel that only reads the entries, and the byte floor: bytes read + written
//! over the in-run device copy bandwidth, and (stricter) over the copy's read+write rate.

use kvshard::backend::{upload_i64s, Backend, MemoryKind};
use kvshard::gpu::bench;
use kvshard::shard::{resolve_owned, Placement, ResolveMode, Resolver};
use kvshard::{backend::i64s_from_bytes, Error, Result};
use rand::Rng;

use crate::harness::{Ctx, Report};

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
            let limit = placement.logical_capacity(64 << 16);
            let entries: Vec<i64> = (0..n)
                .map(|_| {
                    if ctx.rng.random_range(0..10) == 0 {
                        -1
                    } else {
                        ctx.rng.random_range(0..limit as i64)
                    }
                })
                .collect();
            let input = upload_i64s(&ctx.backend, &entries)?;
            let read = ctx.time(ctx.reps(30), || {
                // SAFETY: `input` holds 8n bytes and `sink` 8, both live device buffers.
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
            let mut resolver = Resolver::new(&ctx.backend, n)?;
            let stats = ctx.time(ctx.reps(30), || {
                // SAFETY: `input` holds n int64 entries on this backend.
                unsafe {
                    resolver.resolve_device(
                        &ctx.backend,
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
                    .read(resolver.count_buffer(), 0, 8)?
                    .try_into()
                    .expect("8 bytes"),
            ) as usize;
            let local = i64s_from_bytes(&ctx.backend.read(resolver.local(), 0, 8 * count)?);
            if count != expected.local.len()
                || local
                    .iter()
                    .zip(&expected.local)
                    .any(|(a, b)| *a as u64 != *b)
            {
                return Err(Error::InvalidArgument(format!(
                    "resolve of {n} entries disagrees with the reference"
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
