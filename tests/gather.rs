//! Release order (issue 14): descriptor counts after allocator churn.

use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::TransferPlan;
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::shard::{AllocRequest, Allocation, ChainStart, Placement, ShardAllocator};
use kvshard::transfer::{ChunkRange, PoolLayout, PrefillRank, Registration, SendPlan};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The production geometry: 61 target layers (every fourth shares its indexer) and the draft.
fn production() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        (0..61).map(|i| i % 4 != 3).collect(),
    ))
}

trait Policy {
    fn alloc_batch(&mut self, reqs: &[AllocRequest]) -> kvshard::Result<Vec<Allocation>>;
    fn free(&mut self, pages: &[LogicalPage]) -> kvshard::Result<()>;
}

impl Policy for ShardAllocator {
    fn alloc_batch(&mut self, reqs: &[AllocRequest]) -> kvshard::Result<Vec<Allocation>> {
        ShardAllocator::alloc_batch(self, reqs)
    }
    fn free(&mut self, pages: &[LogicalPage]) -> kvshard::Result<()> {
        ShardAllocator::free(self, pages)
    }
}

/// Average descriptors per P/D chunk (all ranks) and runs per HiCache transfer (all ranks)
/// after churn: requests come and go in random sizes; every 10 cycles a 4,096-token request is
/// allocated, planned (one final P/D chunk into an unsharded decode pool whose allocator churns
/// alike, and a HiCache backup into a churned host pool), then freed.
fn churn_counts<P: Policy>(n: u32, make: impl Fn(u32, u64) -> P) -> (f64, f64) {
    let placement = Placement::new(n).unwrap();
    let (ppr, host_ppr) = (512u64, 2048u64);
    // Room for whatever the prefill group holds, plus a measurement request.
    let decode_pages = u64::from(n) * ppr + 128;
    let mut prefill = make(n, ppr);
    let mut decode = make(1, decode_pages);
    let mut host = make(n, host_ppr);
    let mut rng = StdRng::seed_from_u64(14);
    let mut live: Vec<(Vec<LogicalPage>, Vec<LogicalPage>, Vec<LogicalPage>)> = Vec::new();
    let new = |pages| AllocRequest {
        chain: ChainStart::New,
        pages,
    };
    let free_one = |live: &mut Vec<(Vec<_>, Vec<_>, Vec<_>)>,
                    prefill: &mut P,
                    decode: &mut P,
                    host: &mut P,
                    rng: &mut StdRng| {
        let i = rng.random_range(0..live.len());
        let (p, d, h) = live.swap_remove(i);
        prefill.free(&p).unwrap();
        decode.free(&d).unwrap();
        host.free(&h).unwrap();
    };
    let layout = PoolLayout::packed(production(), ppr);
    let (mut pd, mut hc, mut samples) = (0usize, 0usize, 0usize);
    for cycle in 0..600 {
        let sizes: Vec<usize> = (0..rng.random_range(1..=4))
            .map(|_| rng.random_range(2..=48))
            .collect();
        loop {
            let reqs: Vec<AllocRequest> = sizes.iter().map(|&s| new(s)).collect();
            let Ok(p) = prefill.alloc_batch(&reqs) else {
                free_one(&mut live, &mut prefill, &mut decode, &mut host, &mut rng);
                continue;
            };
            let d = decode.alloc_batch(&reqs).unwrap();
            let h = host
                .alloc_batch(
                    &p.iter()
                        .map(|a| AllocRequest {
                            chain: ChainStart::Extend {
                                start_owner: a.start_owner,
                                prefix_tokens: 0,
                            },
                            pages: a.pages.len(),
                        })
                        .collect::<Vec<_>>(),
                )
                .unwrap();
            for ((p, d), h) in p.into_iter().zip(d).zip(h) {
                live.push((p.pages, d.pages, h.pages));
            }
            break;
        }
        while live.len() > 6 && rng.random_bool(0.5) {
            free_one(&mut live, &mut prefill, &mut decode, &mut host, &mut rng);
        }
        if cycle % 10 != 9 {
            continue;
        }
        // A 4,096-token request, once the pools have churned.
        let mut got = None;
        while got.is_none() {
            match prefill.alloc_batch(&[new(64)]) {
                Ok(mut a) => got = a.pop(),
                Err(_) => free_one(&mut live, &mut prefill, &mut decode, &mut host, &mut rng),
            }
        }
        let Some(chain) = got else { unreachable!() };
        let dst = decode.alloc_batch(&[new(64)]).unwrap().remove(0).pages;
        let host_pages = host
            .alloc_batch(&[AllocRequest {
                chain: ChainStart::Extend {
                    start_owner: chain.start_owner,
                    prefix_tokens: 0,
                },
                pages: 64,
            }])
            .unwrap()
            .remove(0)
            .pages;
        let local: Vec<LocalPage> = dst.iter().map(|p| LocalPage(p.0)).collect();
        let registration = Registration {
            request: 1,
            layout: PoolLayout::packed(production(), decode_pages),
            prefix_pages: 0,
            pages: local.clone(),
            state_pages: local,
        };
        for rank in 0..n {
            let source = PrefillRank {
                placement,
                rank,
                layout: layout.clone(),
            };
            let chunk = ChunkRange {
                index: 0,
                start: 0,
                end: 64 * 64,
                last: true,
            };
            pd += SendPlan::new(&source, &chain.pages, &registration, chunk)
                .unwrap()
                .descriptor_count();
            hc += TransferPlan::new(placement, rank, &chain.pages, &host_pages, ppr, host_ppr)
                .unwrap()
                .runs()
                .len();
        }
        samples += 1;
        prefill.free(&chain.pages).unwrap();
        decode.free(&dst).unwrap();
        host.free(&host_pages).unwrap();
    }
    (pd as f64 / samples as f64, hc as f64 / samples as f64)
}

#[test]
fn descriptor_counts_after_churn() {
    for n in [1, 2, 4, 8] {
        let (pd, hc) = churn_counts(n, |n, ppr| {
            ShardAllocator::new(Placement::new(n).unwrap(), ppr).unwrap()
        });
        eprintln!("N={n}: {pd:.1} descriptors per P/D chunk, {hc:.1} runs per HiCache transfer");
    }
}
