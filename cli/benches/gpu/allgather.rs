//! The CP all-gather on two GPUs (feature `nccl`; issue 14): pack + NCCL all-gather of every
//! layer, layer by layer, into the attention scratch (`kvshard::nccl::CpGather`), next to NCCL's
//! all-gather of the same bytes from one contiguous buffer measured in the same run (the
//! ceiling). The scratch is checked through the page table against the unsharded pool after
//! timing. Skipped, saying why, without two GPUs or NCCL.

use kvshard::Result;
use kvshard_cli::measure::gbps;

use crate::cp_gather::{two_gpu_gather, Shape};
use crate::harness::{Ctx, Report, Timed};

pub fn run(ctx: &mut Ctx, report: &mut Report) -> Result<()> {
    let prefixes: &[usize] = if ctx.quick { &[64] } else { &[16, 64, 256] };
    for &prefix_pages in prefixes {
        let shape = Shape {
            layers: 61,
            pages_per_rank: (4 * prefix_pages + 8) as u64,
            requests: 4,
            prefix_pages,
            ctas: 32,
            repeats: if ctx.quick { 3 } else { 7 },
        };
        let f = match two_gpu_gather(&shape)? {
            Ok(f) => f,
            Err(why) => {
                println!("allgather: SKIPPED ({why})");
                return Ok(());
            }
        };
        let contiguous = gbps(f.gathered_bytes, f.contiguous.median);
        report.add(
            "allgather",
            format!(
                "CP2, 4 requests x {prefix_pages} prefix pages, 61+1 layers: pack + all-gather per layer"
            ),
            f.gathered_bytes,
            Timed {
                stats: f.pack_gather,
                view: f.pack_gather_view,
            },
            ("one contiguous NCCL all-gather", contiguous),
            format!(
                "block {} pages per rank; contiguous all-gather of the same bytes {:.3} ms; scratch verified through the page table",
                f.block, f.contiguous.median
            ),
        );
    }
    Ok(())
}
