//! The transfer scenario's configuration, identical in every process: its cases, requests
//! and methods.

use std::time::Duration;

use kvshard::backend::Launch;
use kvshard::chain::RequestChain;
use kvshard::copy::Method;
use kvshard::geometry::PAGE_SIZE;
use kvshard::shard::ShardAllocator;
use kvshard::transfer::ChunkEnd;
use kvshard::{Error, Result};

use super::{list, shape_args, Processes};
use crate::scenario::{Platform, Shape};

/// Tokens the last page of a request leaves empty: a request ends inside a page, as real ones
/// do (the partial page is sent whole with the final chunk).
const TAIL_TOKENS: usize = 16;

/// One run of the transfer scenario, identical in every process of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdConfig {
    /// The cache and the CP group: `ranks` prefill processes.
    pub shape: Shape,
    /// Where the processes run (one decode).
    pub processes: Processes,
    /// Request sizes in pages, one case each per method.
    pub pages: Vec<usize>,
    /// Pages per prefill chunk.
    pub chunk_pages: usize,
    /// The methods each size is sent with.
    pub methods: Vec<Method>,
    /// Requests per case (the first is verified).
    pub iterations: usize,
    /// Pause between a rank's chunks (tests use it to land a kill mid-request).
    pub pace: Duration,
}

/// One case: a request size and the method it is sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    /// Pages of the request.
    pub pages: usize,
    /// How ranks send it.
    pub method: Method,
}

/// The one-launch block copy at `ctas` CTAs of 512 threads: the `pd` scenarios' default shape
/// (`blocks:CTAS:THREADS` names others).
pub fn blocks(ctas: u32) -> Method {
    Method::Kernel(Launch {
        ctas,
        threads: kvshard::abi::KVS_COPY_THREADS.min(512),
    })
}

impl PdConfig {
    /// The default for the CPU twin (small, seconds) or GPUs (the production shape).
    pub fn default_for(platform: Platform) -> Self {
        let gpu = platform.is_gpu();
        Self {
            shape: Shape {
                ranks: 2,
                layers: if gpu { 61 } else { 4 },
                draft: true,
                seed: 7,
            },
            processes: Processes::new(platform, 1),
            pages: if gpu {
                vec![64, 512, 4096]
            } else {
                vec![9, 40]
            },
            chunk_pages: if gpu { 64 } else { 4 },
            methods: vec![
                blocks(if gpu { 32 } else { 2 }),
                Method::CopyEngine,
                Method::PerBlock,
            ],
            iterations: if gpu { 3 } else { 1 },
            pace: Duration::ZERO,
        }
    }

    /// Checks the run makes sense before any process starts: the shape, one decode, request
    /// sizes of a page or more, a method, an iteration, launch shapes the copy kernel takes.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("pd: {why}")));
        self.shape.check()?;
        self.processes.check(self.shape.ranks)?;
        if self.processes.decodes != 1 {
            return bad(format!(
                "{} decodes: the transfer scenario has one",
                self.processes.decodes
            ));
        }
        // A request's tokens, and the decode pool's pages around it, are counted in `usize`.
        let fits = |pages: usize| {
            pages
                .checked_add(2)
                .and_then(|p| p.checked_mul(PAGE_SIZE))
                .is_some()
        };
        if self.pages.is_empty() || self.pages.iter().any(|&p| p == 0 || !fits(p)) {
            return bad(format!(
                "request sizes {:?} (each at least one page, and countable in tokens)",
                self.pages
            ));
        }
        if !fits(self.chunk_pages) {
            return bad(format!("chunks of {} pages", self.chunk_pages));
        }
        if self.methods.is_empty() || self.iterations == 0 || self.chunk_pages == 0 {
            return bad("no method, no iteration or empty chunks".into());
        }
        if self.pace >= self.processes.deadline {
            return bad(format!(
                "a pause of {} ms between chunks, not below the decode's deadline of {} ms: every \
                 request of more than one chunk would be overdue",
                self.pace.as_millis(),
                self.processes.deadline.as_millis()
            ));
        }
        // Requests are numbered case by case, iteration by iteration, and messages name both.
        let requests = self.cases().len().checked_mul(self.iterations);
        if requests.and_then(|n| u32::try_from(n).ok()).is_none() {
            return bad(format!(
                "{} cases x {} iterations",
                self.cases().len(),
                self.iterations
            ));
        }
        self.methods.iter().try_for_each(check_method)
    }

    /// Every case, sizes outer, methods inner.
    pub fn cases(&self) -> Vec<Case> {
        self.pages
            .iter()
            .flat_map(|&pages| {
                self.methods
                    .iter()
                    .map(move |&method| Case { pages, method })
            })
            .collect()
    }

    /// The request id of iteration `iteration` of case `case`.
    pub fn request_id(&self, case: usize, iteration: usize) -> u64 {
        (case * self.iterations + iteration) as u64 + 1
    }

    /// The case and iteration of request `request`.
    pub fn case_of(&self, request: u64) -> Option<(usize, usize, Case)> {
        let k = usize::try_from(request.checked_sub(1)?).ok()?;
        let (case, iteration) = (k / self.iterations, k % self.iterations);
        self.cases().get(case).map(|&c| (case, iteration, c))
    }

    /// Tokens of a request of `pages` pages.
    pub fn tokens(pages: usize) -> usize {
        (pages * PAGE_SIZE).saturating_sub(TAIL_TOKENS).max(1)
    }

    /// Where each chunk of a request of `tokens` tokens ends.
    pub fn chunk_ends(&self, tokens: usize) -> Vec<ChunkEnd> {
        let step = self.chunk_pages * PAGE_SIZE;
        let mut ends: Vec<ChunkEnd> = (1..)
            .map(|k| k * step)
            .take_while(|&end| end < tokens)
            .map(ChunkEnd::Partial)
            .collect();
        ends.push(ChunkEnd::Final(tokens));
        ends
    }

    fn max_pages(&self) -> usize {
        self.pages.iter().copied().max().unwrap_or(1)
    }

    /// Pages of each prefill rank's pool.
    pub fn prefill_pages(&self) -> u64 {
        (self.max_pages().div_ceil(self.shape.ranks.max(1) as usize) + 2) as u64
    }

    /// Pages of the decode pool.
    pub fn decode_pages(&self) -> u64 {
        (self.max_pages() + 2) as u64
    }

    /// The prefill group's chain of a request of `pages` pages: every rank (and the decode's
    /// check) runs the rotated allocator identically from an empty pool.
    pub fn prefill_chain(&self, pages: usize) -> Result<RequestChain> {
        let placement = self.shape.placement()?;
        let mut allocator = ShardAllocator::new(placement, self.prefill_pages())?;
        let mut chain = RequestChain::new(placement);
        chain.grow_to(&mut allocator, Self::tokens(pages))?;
        Ok(chain)
    }

    /// The command-line flags that give this configuration (after `pd`).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = shape_args(&self.shape);
        args.extend(self.processes.to_args());
        args.extend([
            "--pages".into(),
            list(&self.pages),
            "--chunk-pages".into(),
            self.chunk_pages.to_string(),
            "--methods".into(),
            self.methods
                .iter()
                .map(method_name)
                .collect::<Vec<_>>()
                .join(","),
            "--iterations".into(),
            self.iterations.to_string(),
            "--pace-ms".into(),
            self.pace.as_millis().to_string(),
        ]);
        args
    }
}

/// A method as the command line names it: `blocks:CTAS:THREADS` (the block kernel),
/// `ranges:CTAS:THREADS` (the range kernel), `ce`, `naive` (per block); `batch` names the batched
/// copy engine, which no P/D transport runs.
pub fn method_name(method: &Method) -> String {
    match method {
        Method::Kernel(l) => format!("blocks:{}:{}", l.ctas, l.threads),
        Method::RangeKernel(l) => format!("ranges:{}:{}", l.ctas, l.threads),
        Method::CopyEngine => "ce".into(),
        Method::BatchedCopyEngine => "batch".into(),
        Method::PerBlock => "naive".into(),
    }
}

/// Parses [`method_name`]'s form (`blocks:CTAS` and `ranges:CTAS` take 512 threads) and checks
/// it ([`check_method`]).
pub fn parse_method(s: &str) -> Result<Method> {
    let bad = || {
        Error::InvalidArgument(format!(
            "method {s:?}: expected blocks:CTAS[:THREADS], ranges:CTAS[:THREADS], ce or naive"
        ))
    };
    let mut parts = s.split(':');
    let method = match parts.next() {
        Some("ce") if parts.next().is_none() => Method::CopyEngine,
        Some("naive") if parts.next().is_none() => Method::PerBlock,
        Some(kind @ ("blocks" | "ranges")) => {
            let ctas = parts.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
            let threads = match parts.next() {
                Some(t) => t.parse().map_err(|_| bad())?,
                None => 512,
            };
            if parts.next().is_some() {
                return Err(bad());
            }
            let launch = Launch { ctas, threads };
            if kind == "blocks" {
                Method::Kernel(launch)
            } else {
                Method::RangeKernel(launch)
            }
        }
        _ => return Err(bad()),
    };
    check_method(&method)?;
    Ok(method)
}

/// Checks a method the P/D transports run, and a kernel's launch shape against what the copy
/// kernels were compiled for (a device may allow fewer threads; the library refuses those when
/// it launches).
pub fn check_method(method: &Method) -> Result<()> {
    match method {
        Method::Kernel(launch) | Method::RangeKernel(launch) => {
            launch.validate(kvshard::abi::KVS_COPY_THREADS)
        }
        Method::CopyEngine | Method::PerBlock => Ok(()),
        Method::BatchedCopyEngine => Err(Error::UnsupportedMethod {
            method: method.to_string(),
            route: "a P/D transport",
            accepts: "blocks, ranges, ce or naive",
        }),
    }
}
