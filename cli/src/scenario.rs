//! What every run of the applications describes the same way: the cache and the CP group that
//! holds it ([`Shape`]), where the run executes ([`Platform`]), and the seed's pressure scenario
//! ([`PressureConfig`]), which `kvshard demo --scenario pressure` runs in one process and
//! `kvshard pd --scenario pressure` across processes. The one-request demo ([`crate::demo`]) and
//! the P/D transfer matrix ([`crate::pd`]) embed a [`Shape`] too, so the command line maps
//! `--ranks`, `--layers`, `--no-draft` and `--seed` once, and every process of a `pd` run derives
//! the same geometry and placement from it.

use std::fmt;

use kvshard::backend::Launch;
use kvshard::copy::{Method, Staging};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry, PAGE_SIZE};
use kvshard::hicache::{Route, AUTO_RELAYOUT_CTAS};
use kvshard::pool::{Budget, BudgetRequest};
use kvshard::shard::{AdmissionLimits, Placement, ScratchLayout};
use kvshard::{Error, Result};

/// Most CP ranks a run may have: what a P/D receiver accepts per request.
pub const MAX_RANKS: u32 = kvshard::transfer::MAX_PREFILL_RANKS;

/// Most target layers a run may have: far above any model (DeepSeek-V3.2 has 61, GLM-5 78),
/// and well inside the 32-bit layer indices of the kernels' pair tables and ready counters.
pub const MAX_LAYERS: usize = 4096;

/// Where a run executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Platform {
    /// The CPU backend: the reference twin of every kernel (memfd pools across processes).
    Cpu,
    /// CUDA GPUs.
    Gpu,
}

impl Platform {
    /// Whether the run is on GPUs.
    pub fn is_gpu(self) -> bool {
        self == Platform::Gpu
    }

    /// The HiCache route the scenarios use: on a GPU the copy engine through device staging
    /// with a block-kernel relayout of [`AUTO_RELAYOUT_CTAS`] CTAs, `Route::auto`'s pick for
    /// the scenario's 64-page loads (H200 2026-12-02 at a8be63e: 96-97% of pinned H2D; the
    /// copy-engine relayout spends 1.7 ms of host time enqueueing its 2D copies and reaches
    /// 87.7%), named here so the CPU twin can take the plain copy engine instead.
    /// The relayout's CTAs take the copy kernels' compiled thread count, what
    /// [`Launch::host_io`] gives on every architecture built.
    pub fn route(self) -> Route {
        match self {
            Platform::Gpu => Route::Staged(Method::Kernel(Launch {
                ctas: AUTO_RELAYOUT_CTAS,
                threads: kvshard::abi::KVS_COPY_THREADS,
            })),
            Platform::Cpu => Route::Direct(Method::CopyEngine),
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Platform::Cpu => "the CPU twin",
            Platform::Gpu => "GPUs",
        })
    }
}

/// The cache a run holds and the CP group that holds it; the same in every process of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// CP shard size N: the prefill ranks.
    pub ranks: u32,
    /// Target layers (every fourth one shares its indexer).
    pub layers: usize,
    /// Whether the single-layer MTP draft is present.
    pub draft: bool,
    /// Seed of the synthetic KV.
    pub seed: u64,
}

impl Shape {
    /// The cache: FP8 "trtllm" latent rows, every fourth target layer sharing its indexer (a
    /// zero-size indexer buffer), and the MTP draft when [`Shape::draft`].
    pub fn geometry(&self) -> CacheGeometry {
        let target = PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            (0..self.layers).map(|i| i % 4 != 3).collect(),
        );
        if self.draft {
            CacheGeometry::with_draft(target)
        } else {
            CacheGeometry::target_only(target)
        }
    }

    /// The CP group's placement.
    pub fn placement(&self) -> Result<Placement> {
        Placement::new(self.ranks)
    }

    /// Checks the bounds: 1 to [`MAX_RANKS`] ranks, 1 to [`MAX_LAYERS`] target layers, a valid
    /// geometry.
    pub fn check(&self) -> Result<()> {
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(Error::InvalidArgument(format!(
                "{} ranks: a run has 1 to {MAX_RANKS} CP ranks",
                self.ranks
            )));
        }
        if self.layers == 0 || self.layers > MAX_LAYERS {
            return Err(Error::InvalidArgument(format!(
                "{} layers: a model has 1 to {MAX_LAYERS} target layers",
                self.layers
            )));
        }
        self.geometry().validate()
    }
}

impl fmt::Display for Shape {
    /// `CP2, 61 layers + MTP draft`: how every report names the run's shape.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CP{}, {} layers{}",
            self.ranks,
            self.layers,
            if self.draft { " + MTP draft" } else { "" }
        )
    }
}

/// The seed's accuracy scenario scaled to the machine. A seeded prefix is prefilled and written
/// through to the host (its backup awaited); then two prompts, which together exceed the CP
/// group's logical GPU slots but fit, with the prefix, in a host cache `host_factor` times
/// larger, are prefilled chunk by chunk, every chunk admitted as SGLang schedules it. The first
/// (a prompt of its own) forces the prefix out of the GPU; the second (the prefix, then new
/// tokens) forces the first out and reloads the prefix from the host (H2D grows), and every one
/// of its chunks reads its prefix through the gather plan: each rank packs its send list, the
/// all-gather lands the send buffers in every rank's scratch owner-major, and the scratch read
/// through the page table must equal the unsharded reference's pages in chain order. Both
/// prompts are sent P/D; every decode pool must be byte-identical to what an unsharded reference
/// prefill (which never evicts) sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressureConfig {
    /// The cache and the CP group.
    pub shape: Shape,
    /// Logical token slots of the CP group's device pools (N x physical slots).
    pub logical_slots: u64,
    /// Tokens of each prompt (the second one's seeded prefix included).
    pub prompt_tokens: usize,
    /// Tokens of the seeded prefix (a multiple of 64, shorter than a prompt).
    pub prefix_tokens: usize,
    /// Prefill chunk size in tokens (a multiple of 64).
    pub chunk: usize,
    /// How many times the device pools' pages each host pool holds.
    pub host_factor: u64,
}

impl PressureConfig {
    /// The seed's shape (CP2, 16,384 logical slots, two 12,288-token prompts, a 4,096-token
    /// prefix, a host cache 4x larger): on GPUs with 61 layers and the draft; on the CPU twin
    /// with 2 layers and the draft, so it runs in seconds.
    pub fn default_for(platform: Platform) -> Self {
        Self {
            shape: Shape {
                ranks: 2,
                layers: if platform.is_gpu() { 61 } else { 2 },
                draft: true,
                seed: 11,
            },
            logical_slots: 16_384,
            prompt_tokens: 12_288,
            prefix_tokens: 4_096,
            chunk: 2_048,
            host_factor: 4,
        }
    }

    /// Physical pages per rank, after checking the scenario is what it claims: page-aligned
    /// sizes; one prompt fits the empty device pools; the prefix and a prompt do not (so the
    /// prompts force evictions); the host pools hold the prefix and both prompts.
    pub fn pages_per_rank(&self) -> Result<u64> {
        let invalid =
            |why: String| Err(Error::InvalidArgument(format!("pressure scenario: {why}")));
        self.shape.check()?;
        let page = PAGE_SIZE as u64;
        let stride = u64::from(self.shape.ranks) * page;
        if self.chunk == 0 || self.chunk % PAGE_SIZE != 0 {
            return invalid(format!(
                "chunks of {} tokens (a non-zero multiple of 64)",
                self.chunk
            ));
        }
        if self.prefix_tokens == 0
            || self.prefix_tokens % PAGE_SIZE != 0
            || self.prefix_tokens >= self.prompt_tokens
        {
            return invalid(format!(
                "a prefix of {} tokens (a non-zero multiple of 64, shorter than the {}-token prompts)",
                self.prefix_tokens, self.prompt_tokens
            ));
        }
        if self.logical_slots % stride != 0 || self.logical_slots / stride < 2 {
            return invalid(format!(
                "{} logical slots are not whole pages of {} ranks (a multiple of {stride}), at least 2 each",
                self.logical_slots, self.shape.ranks
            ));
        }
        let per_rank = self.logical_slots / stride;
        // What an allocator of `pages` pages per rank admits when empty, and what a request of
        // `tokens` tokens reserves.
        let admits = |pages: u64| (pages - 1).saturating_mul(stride);
        let reserve = |tokens: usize| (tokens as u64).saturating_add(stride);
        if reserve(self.prompt_tokens) > admits(per_rank) {
            return invalid(format!(
                "a {}-token prompt does not fit {} logical slots",
                self.prompt_tokens, self.logical_slots
            ));
        }
        if reserve(self.prefix_tokens.saturating_add(self.prompt_tokens)) <= admits(per_rank) {
            return invalid(format!(
                "the prefix and a prompt fit {} logical slots together: nothing would be evicted",
                self.logical_slots
            ));
        }
        let host = per_rank.saturating_mul(self.host_factor);
        let backed_up = reserve(self.prefix_tokens)
            .saturating_add(reserve(self.prompt_tokens))
            .saturating_add(reserve(self.prompt_tokens - self.prefix_tokens));
        if host < 2 || backed_up > admits(host) {
            return invalid(format!(
                "host pools of {host} pages per rank do not hold the prefix and both prompts"
            ));
        }
        Ok(per_rank)
    }

    /// Pages of the unsharded reference, which never evicts: room for the prefix and both
    /// prompts, and the padding page.
    pub fn reference_pages(&self) -> u64 {
        let tokens = (self.prompt_tokens as u64)
            .saturating_mul(2)
            .saturating_add(self.prefix_tokens as u64);
        tokens.div_ceil(PAGE_SIZE as u64).saturating_add(2)
    }

    /// The admission limits every process of the scenario applies, and the attention scratch of
    /// a sharded group (`None` unsharded: attention reads the pool itself). One request per
    /// batch here: the scratch holds one context's prefix (C = 1).
    pub fn scratch(&self) -> Result<(AdmissionLimits, Option<ScratchLayout>)> {
        let chunk_tokens = self.chunk as u64;
        if self.shape.ranks <= 1 {
            let limits = AdmissionLimits {
                max_prefix_tokens: u64::MAX,
                chunk_tokens,
            };
            return Ok((limits, None));
        }
        let mut budget = BudgetRequest::new(u64::MAX, self.prompt_tokens as u64, chunk_tokens);
        budget.contexts = 1;
        let (_, max_prefix) = Budget::scratch(&budget, self.shape.ranks)?;
        let limits = AdmissionLimits {
            max_prefix_tokens: max_prefix,
            chunk_tokens,
        };
        Ok((limits, Some(ScratchLayout::new(max_prefix, chunk_tokens)?)))
    }

    /// Pages of a rank's send buffer: a block never exceeds the prefix region's share of one
    /// owner (0 unsharded).
    pub fn send_pages(&self) -> Result<u64> {
        let (_, layout) = self.scratch()?;
        Ok(layout.map_or(0, |l| {
            (l.prefix_pages() / u64::from(self.shape.ranks)).max(1)
        }))
    }

    /// Bytes of a rank's send buffer: what each rank puts in its slot of a host-staged
    /// all-gather.
    pub fn send_bytes(&self) -> Result<usize> {
        match self.send_pages()? {
            0 => Ok(0),
            pages => Staging::required_bytes(&self.shape.geometry(), pages),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fourth_layer_shares_its_indexer_and_the_draft_is_optional() {
        let shape = Shape {
            ranks: 2,
            layers: 8,
            draft: true,
            seed: 1,
        };
        let g = shape.geometry();
        assert_eq!(g.target.num_indexer_layers(), 6);
        assert!(g.draft.is_some());
        let without = Shape {
            draft: false,
            ..shape.clone()
        };
        assert!(without.geometry().draft.is_none());
        assert_eq!(shape.to_string(), "CP2, 8 layers + MTP draft");
        assert_eq!(without.to_string(), "CP2, 8 layers");
    }

    #[test]
    fn shapes_out_of_bounds_are_refused() {
        let ok = Shape {
            ranks: 1,
            layers: 1,
            draft: false,
            seed: 0,
        };
        assert!(ok.check().is_ok());
        for bad in [
            Shape {
                ranks: 0,
                ..ok.clone()
            },
            Shape {
                ranks: MAX_RANKS + 1,
                ..ok.clone()
            },
            Shape {
                layers: 0,
                ..ok.clone()
            },
            Shape {
                layers: MAX_LAYERS + 1,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.check(), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_scenario_without_pressure_or_where_a_prompt_cannot_fit_is_refused() {
        let default = PressureConfig::default_for(Platform::Cpu);
        assert_eq!(default.pages_per_rank().unwrap(), 16_384 / 128);
        let mut ranks3 = default.clone();
        ranks3.shape.ranks = 3;
        for bad in [
            PressureConfig {
                prompt_tokens: 6000,
                ..default.clone()
            },
            PressureConfig {
                prompt_tokens: 20_000,
                ..default.clone()
            },
            PressureConfig {
                prefix_tokens: 100,
                ..default.clone()
            },
            PressureConfig {
                chunk: 100,
                ..default.clone()
            },
            ranks3,
        ] {
            assert!(
                matches!(bad.pages_per_rank(), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }
}
