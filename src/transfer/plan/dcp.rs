//! P/D into a decode server sharded by token (docs/dcp.md): what the decode ranks register for a
//! request ([`DecodeRegistration`]: the [`DecodeLayout`], the request's tokens and every decode
//! rank's pages) and what one prefill rank moves for one chunk of it ([`DecodePlan`]: plain data,
//! built on the CPU without a backend, every page checked).
//!
//! A prefill rank owns whole pages of the sequence (position `P` on rank `(b + P) % N`); a decode
//! rank owns tokens (`DecodeLayout::place`). So a chunk's plan is the rank's owned positions of
//! the chunk, each a source page whose rows go to every decode rank that owns one of its tokens:
//! the plan keeps (local source page, sequence page) per owned position and the copy layer's
//! [`DecodeScatterPlan`] places the rows. Sections and their order are
//! [`SendPlan`](super::SendPlan)'s: the
//! latent KV of the chunk's pages (after the decode's cached prefix), then with the final chunk
//! the indexer state of the whole sequence from position 0. Rows of tokens past the sequence's
//! end so far are never moved (a non-final chunk sends only its whole pages).
//!
//! Every decode rank completes a request after a final status from every prefill rank (its
//! share of the registration, [`DecodeRegistration::rank`], is an ordinary [`Registration`] of
//! its pages for its [`Receiver`](super::super::Receiver)): a prefill rank reports every chunk to
//! every decode rank, with the bytes that reached that rank (nothing, for a pair that shares no
//! token: it still completes).

use std::ops::Range;
use std::sync::Arc;

use super::build::{check_layouts, check_sources};
use super::{ChunkRange, PoolLayout, PrefillRank, Registration, SectionComponent};
use crate::chunk_status::ComponentBytes;
use crate::copy::{BlockSpace, DecodeScatterPlan, ScatterRank, ScatterSection};
use crate::error::{Checked, Error, Result};
use crate::geometry::{INDEXER_ROW_BYTES, PAGE_SIZE};
use crate::index::{LocalPage, LogicalPage};
use crate::shard::{DecodeLayout, Placement};

const PAGE: u64 = PAGE_SIZE as u64;

/// One decode rank's part of a [`DecodeRegistration`]: its pool, and the page holding each of
/// its local pages of the request (docs/dcp.md: local token `k` of the rank is row `k % 64` of
/// `pages[k / 64]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRank {
    /// The rank's pool.
    pub layout: PoolLayout,
    /// Page of each of the rank's local pages of the request, from its first: every page the
    /// request's tokens on this rank occupy, the cached prefix's included (a page may hold both
    /// cached rows and rows to receive; cached rows are never written).
    pub pages: Vec<LocalPage>,
    /// Page of the indexer state of each local page, as many as `pages` (empty when the cache
    /// has no indexer layer); often the same pages.
    pub state_pages: Vec<LocalPage>,
}

/// What the ranks of a decode server sharded by token registered for one request; the same
/// registration goes to every prefill rank of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRegistration {
    /// Request id.
    pub request: u64,
    /// How the decode server shards the request.
    pub layout: DecodeLayout,
    /// Tokens of the request's sequence: what the final chunk ends at, and what sizes each
    /// rank's share (`DecodeLayout::pages_on`).
    pub tokens: usize,
    /// Leading pages of the sequence the decode ranks already hold (their cached prefix): never
    /// sent; chunks start after them.
    pub prefix_pages: usize,
    /// Every decode rank, in rank order.
    pub ranks: Vec<DecodeRank>,
}

impl DecodeRegistration {
    /// Checks what the registration can be checked for alone: one entry per rank of the
    /// layout, every rank's pool of the same geometry and strides, each rank's pages exactly
    /// its share of the request's tokens, in its pool, not its padding page 0, each list free of
    /// repeats, state pages present exactly when the cache has an indexer, the prefix inside
    /// the request. Senders check it when a registration is opened, receivers through each
    /// rank's share.
    pub fn validate(&self) -> Result<()> {
        let request = self.request;
        let fail = |reason: String| Err(Error::Transfer { request, reason });
        let m = self.layout.ranks();
        if self.ranks.len() != m as usize {
            return fail(format!(
                "{} decode ranks registered for a layout of {m}",
                self.ranks.len()
            ));
        }
        let tokens = self.tokens as u64;
        if tokens > crate::abi::KVS_DECODE_MAX_TOKENS {
            return fail(format!(
                "{tokens} tokens (a decode context-parallel request holds at most {})",
                crate::abi::KVS_DECODE_MAX_TOKENS
            ));
        }
        let prefix = self.prefix_tokens()?;
        if prefix > self.tokens {
            return fail(format!(
                "a cached prefix of {} pages in a request of {tokens} tokens",
                self.prefix_pages
            ));
        }
        let first = &self.ranks[0].layout;
        for (d, rank) in (0u32..).zip(&self.ranks) {
            if rank.layout.geometry != first.geometry
                || rank.layout.page_strides != first.page_strides
            {
                return fail(format!(
                    "decode rank {d} registered another cache geometry or page strides than rank 0"
                ));
            }
            let needed = self.layout.pages_on(d, tokens);
            let indexer = rank
                .layout
                .geometry
                .components()
                .iter()
                .any(|c| c.component.is_indexer());
            let state_needed = if indexer { needed } else { 0 };
            for (what, pages, want) in [
                ("pages", &rank.pages, needed),
                ("state pages", &rank.state_pages, state_needed),
            ] {
                if pages.len() as u64 != want {
                    return fail(format!(
                        "decode rank {d} registered {} {what}; its share of {tokens} tokens under {} takes {want}",
                        pages.len(),
                        self.layout
                    ));
                }
            }
            // Each rank's share is an unsharded registration of its own pages: its checks
            // (range, padding page, repeats) are those.
            self.rank(d)?.validate().map_err(|e| match e {
                Error::Transfer { request, reason } => Error::Transfer {
                    request,
                    reason: format!("decode rank {d}: {reason}"),
                },
                other => other,
            })?;
        }
        Ok(())
    }

    /// Tokens of the decode's cached prefix.
    pub fn prefix_tokens(&self) -> Result<usize> {
        self.prefix_pages.mul_or(PAGE_SIZE, || {
            format!("tokens of a {}-page prefix", self.prefix_pages)
        })
    }

    /// Decode rank `rank`'s share as an ordinary registration of its own pages (no prefix: it
    /// lists every page the request occupies on the rank): what that rank's
    /// [`Receiver`](super::super::Receiver) registers, with the prefill group's N ranks, and
    /// hands back when the request is done with.
    pub fn rank(&self, rank: u32) -> Result<Registration> {
        self.layout.check_rank(rank)?;
        let r = self
            .ranks
            .get(rank as usize)
            .ok_or_else(|| Error::Transfer {
                request: self.request,
                reason: format!("decode rank {rank} is not registered"),
            })?;
        Ok(Registration {
            request: self.request,
            layout: r.layout.clone(),
            prefix_pages: 0,
            pages: r.pages.clone(),
            state_pages: r.state_pages.clone(),
        })
    }

    /// Every rank's pages as the copy layer addresses them.
    pub(crate) fn scatter_ranks(&self) -> Arc<[ScatterRank]> {
        self.ranks
            .iter()
            .map(|r| ScatterRank {
                pages: r.pages.clone(),
                state_pages: r.state_pages.clone(),
            })
            .collect()
    }
}

/// One part of a [`DecodePlan`]: the latent KV of the chunk's positions, or the indexer state
/// of the whole sequence, and this rank's source pages of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodeSection {
    positions: Range<usize>,
    components: Vec<SectionComponent>,
    /// (local source page, sequence page) of each owned position, in position order.
    entries: Vec<(LocalPage, u64)>,
}

impl DecodeSection {
    /// Page positions of the sequence the section covers (all prefill ranks' positions).
    pub fn positions(&self) -> Range<usize> {
        self.positions.clone()
    }

    /// Components moved, in send order.
    pub fn components(&self) -> &[SectionComponent] {
        &self.components
    }

    /// This rank's pages of the section: (local source page, sequence page), in position order.
    pub fn entries(&self) -> &[(LocalPage, u64)] {
        &self.entries
    }

    /// Whether this rank moves nothing in the section.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() || self.components.is_empty()
    }

    fn scatter(&self) -> ScatterSection {
        ScatterSection {
            components: self.components.iter().map(|c| c.component).collect(),
            entries: if self.components.is_empty() {
                Vec::new()
            } else {
                self.entries.clone()
            },
        }
    }
}

/// Everything one prefill rank sends for one chunk of one request into a decode server sharded
/// by token: plain data, immutable once built (every page was checked when it was).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodePlan {
    request: u64,
    placement: Placement,
    rank: u32,
    chunk: ChunkRange,
    layout: DecodeLayout,
    end_token: u64,
    kv: DecodeSection,
    state: DecodeSection,
    ranks: Arc<[ScatterRank]>,
    /// Bytes that reach each decode rank, per component.
    rank_bytes: Vec<ComponentBytes>,
}

/// The pages chunk `chunk` of `registration` covers: its first page, the page past the last it
/// sends (a non-final chunk sends only the pages it completed), the sequence's pages so far, and
/// the token its rows end at; checked against the decode's cached prefix and tokens.
fn chunk_pages(
    registration: &DecodeRegistration,
    chunk: ChunkRange,
) -> Result<(usize, usize, usize, u64)> {
    let (request, index) = (registration.request, chunk.index);
    let fail = |reason: String| Err(Error::Transfer { request, reason });
    if chunk.start % PAGE_SIZE != 0 {
        return fail(format!(
            "chunk {index} starts at token {}, not a page boundary (page size {PAGE_SIZE})",
            chunk.start
        ));
    }
    let prefix = registration.prefix_pages;
    let start_page = chunk.start / PAGE_SIZE;
    if start_page < prefix {
        return fail(format!(
            "chunk {index} starts at page {start_page}, inside the decode's cached prefix of {prefix} pages"
        ));
    }
    let tokens = registration.tokens;
    if chunk.end > tokens || (chunk.last && chunk.end != tokens) {
        return fail(format!(
            "token count mismatch: chunk {index} ends at token {}{}, the decode registered {tokens} tokens",
            chunk.end,
            if chunk.last { " (the final chunk)" } else { "" }
        ));
    }
    let seq_pages = chunk.end.div_ceil(PAGE_SIZE);
    // A non-final chunk sends only the pages it completed; the final one sends the rest.
    let end_page = if chunk.last {
        seq_pages
    } else {
        chunk.end / PAGE_SIZE
    }
    .max(start_page);
    let end_token = if chunk.last {
        chunk.end as u64
    } else {
        (end_page * PAGE_SIZE) as u64
    };
    Ok((start_page, end_page, seq_pages, end_token))
}

/// Bytes each decode rank receives of `sections`, by component: the rows of tokens below
/// `end_token` that land on it, every layer.
fn bytes_per_rank(
    layout: DecodeLayout,
    sections: [&DecodeSection; 2],
    end_token: u64,
) -> Vec<ComponentBytes> {
    let mut rank_bytes = vec![ComponentBytes::default(); layout.ranks() as usize];
    for s in sections {
        if s.components.is_empty() {
            continue;
        }
        let rows = rows_per_rank(layout, &s.entries, end_token);
        for (bytes, rows) in rank_bytes.iter_mut().zip(rows) {
            for c in &s.components {
                let row = if c.component.is_indexer() {
                    INDEXER_ROW_BYTES as u64
                } else {
                    c.item / PAGE
                };
                bytes.add(c.component, rows * row * c.layers as u64);
            }
        }
    }
    rank_bytes
}

impl DecodePlan {
    /// Plans chunk `chunk` of `registration`'s request for `source`. `src_pages` is the prefill
    /// request's logical page of every sequence position so far (its `req_to_token`, by page).
    pub fn new(
        source: &PrefillRank,
        src_pages: &[LogicalPage],
        registration: &DecodeRegistration,
        chunk: ChunkRange,
    ) -> Result<Self> {
        registration.validate()?;
        Self::of_valid(
            source,
            src_pages,
            registration,
            registration.scatter_ranks(),
            chunk,
        )
    }

    /// [`DecodePlan::new`] for a registration [`DecodeRegistration::validate`] has accepted,
    /// whose ranks' pages are `ranks` (a sender makes them once, when it opens the request).
    pub(crate) fn of_valid(
        source: &PrefillRank,
        src_pages: &[LogicalPage],
        registration: &DecodeRegistration,
        ranks: Arc<[ScatterRank]>,
        chunk: ChunkRange,
    ) -> Result<Self> {
        let request = registration.request;
        let fail = |reason: String| Err(Error::Transfer { request, reason });
        let (placement, rank) = (source.placement, source.rank);
        let shard = placement.shard();
        if rank >= shard {
            return fail(format!("prefill rank {rank} of a shard group of {shard}"));
        }
        // validate() checked every decode rank stores what rank 0 does.
        let components = check_layouts(request, &source.layout, &registration.ranks[0].layout)?;
        let index = chunk.index;
        let (start_page, end_page, seq_pages, end_token) = chunk_pages(registration, chunk)?;
        let section = |indexer: bool| -> Vec<SectionComponent> {
            components
                .iter()
                .filter(|c| c.component.is_indexer() == indexer)
                .map(|c| SectionComponent {
                    component: c.component,
                    layers: c.layers(),
                    item: c.block_bytes as u64,
                })
                .collect()
        };
        let state_components = if chunk.last {
            section(true)
        } else {
            Vec::new()
        };
        let state_pages = if state_components.is_empty() {
            0
        } else {
            seq_pages
        };
        let kv_needed = if end_page > start_page { end_page } else { 0 };
        let needed = kv_needed.max(state_pages);
        if src_pages.len() < needed {
            return fail(format!(
                "the prefill page table holds {} pages, chunk {index} needs {needed}",
                src_pages.len()
            ));
        }
        let src_logical = placement.logical_pages(source.layout.pages)?;
        // In bounds: the page table holds `needed` pages.
        let kv_src = if end_page > start_page {
            &src_pages[start_page..end_page]
        } else {
            &[][..]
        };
        check_sources(request, placement, src_logical, start_page, kv_src)?;
        let state_src = &src_pages[..state_pages];
        check_sources(request, placement, src_logical, 0, state_src)?;
        let owned = |first: usize, pages: &[LogicalPage]| -> Vec<(LocalPage, u64)> {
            (first..)
                .zip(pages)
                .filter(|(_, &p)| placement.owner(p) == rank)
                .map(|(position, &p)| (placement.local(p), position as u64))
                .collect()
        };
        let kv = DecodeSection {
            positions: start_page..end_page,
            components: section(false),
            entries: owned(start_page, kv_src),
        };
        let state = DecodeSection {
            positions: 0..state_pages,
            components: state_components,
            entries: owned(0, state_src),
        };
        let layout = registration.layout;
        let rank_bytes = bytes_per_rank(layout, [&kv, &state], end_token);
        Ok(Self {
            request,
            placement,
            rank,
            chunk,
            layout,
            end_token,
            kv,
            state,
            ranks,
            rank_bytes,
        })
    }

    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// Sharding of the prefill group.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// The sending prefill rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The chunk as asked for.
    pub fn chunk(&self) -> ChunkRange {
        self.chunk
    }

    /// The decode layout.
    pub fn layout(&self) -> DecodeLayout {
        self.layout
    }

    /// Tokens at or past this are not moved: the chunk's end (whole pages for a non-final one).
    pub fn end_token(&self) -> u64 {
        self.end_token
    }

    /// Latent KV of the chunk's whole pages (all of them with the final chunk).
    pub fn kv(&self) -> &DecodeSection {
        &self.kv
    }

    /// Indexer state of the whole sequence: final chunk only, empty otherwise.
    pub fn state(&self) -> &DecodeSection {
        &self.state
    }

    /// Bytes that reach each decode rank, per component (what each decode rank's status
    /// carries).
    pub fn rank_bytes(&self) -> &[ComponentBytes] {
        &self.rank_bytes
    }

    /// Bytes this rank moves for the chunk, over every decode rank, per component.
    pub fn bytes(&self) -> ComponentBytes {
        let mut out = ComponentBytes::default();
        for b in &self.rank_bytes {
            out += *b;
        }
        out
    }

    /// Decode ranks the chunk writes rows of: what a transport posting one descriptor per
    /// (chunk, prefill rank, decode rank) posts.
    pub fn decode_ranks_reached(&self) -> usize {
        self.rank_bytes.iter().filter(|b| b.total() > 0).count()
    }

    /// Whether this rank moves nothing for the chunk (it still reports the chunk to every
    /// decode rank).
    pub fn is_empty(&self) -> bool {
        self.bytes().total() == 0
    }

    /// The copy layer's scatter of this plan from `src` (this rank's pool) into `dsts` (one
    /// per decode rank, in rank order), checked against them.
    pub fn scatter(
        &self,
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
    ) -> Result<DecodeScatterPlan> {
        DecodeScatterPlan::new(
            src,
            dsts,
            self.layout,
            self.end_token,
            self.kv.scatter(),
            self.state.scatter(),
            &self.ranks,
        )
        .map_err(|e| Error::Transfer {
            request: self.request,
            reason: e.to_string(),
        })
    }
}

impl DecodePlan {
    /// The copy layer's dense packing of this plan from `src` (this rank's pool) into `dsts`
    /// (one bounce region per decode rank, in rank order; docs/dcp.md, "Over NIXL and
    /// Mooncake"), checked against them.
    pub fn pack(
        &self,
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
    ) -> Result<DecodeScatterPlan> {
        DecodeScatterPlan::pack(
            src,
            dsts,
            self.layout,
            self.end_token,
            self.kv.scatter(),
            self.state.scatter(),
        )
        .map_err(|e| Error::Transfer {
            request: self.request,
            reason: e.to_string(),
        })
    }
}

/// Rows of `entries` (sequence pages) below `end_token` that land on each rank of `layout`.
/// What a whole page gives each rank repeats every `period` pages (its first token's place in a
/// round of I * M tokens), so whole pages are counted by that residue, each residue's share
/// computed once; pages cut by the end, and every page where the period is longer than the
/// entries, one at a time ([`page_rows_per_rank`]).
fn rows_per_rank(layout: DecodeLayout, entries: &[(LocalPage, u64)], end_token: u64) -> Vec<u64> {
    let m = layout.ranks() as usize;
    let mut rows = vec![0u64; m];
    // round / gcd(round, 64): a page is 2^6 tokens.
    let round = u64::from(layout.interleave()) * m as u64;
    let period = round >> round.trailing_zeros().min(PAGE.trailing_zeros());
    if period > entries.len() as u64 {
        for &(_, position) in entries {
            page_rows_per_rank(layout, position, end_token, &mut rows);
        }
        return rows;
    }
    let mut whole = vec![0u64; period as usize];
    for &(_, position) in entries {
        // Sequence pages of a checked chunk: their tokens fit (at most KVS_DECODE_MAX_TOKENS).
        if (position + 1) * PAGE <= end_token {
            whole[(position % period) as usize] += 1;
        } else {
            page_rows_per_rank(layout, position, end_token, &mut rows);
        }
    }
    let mut share = vec![0u64; m];
    for (residue, &count) in (0u64..).zip(&whole).filter(|(_, &count)| count > 0) {
        share.fill(0);
        page_rows_per_rank(layout, residue, u64::MAX, &mut share);
        for (r, s) in rows.iter_mut().zip(&share) {
            *r += count * s;
        }
    }
    rows
}

/// Adds the rows of sequence page `position` below `end_token` that land on each rank to
/// `rows`: the cheaper of walking its interleave groups (a page holds at most 64 / I + 2 of
/// them) and differencing every rank's count ([`DecodeLayout::tokens_on`]).
fn page_rows_per_rank(layout: DecodeLayout, position: u64, end_token: u64, rows: &mut [u64]) {
    let (i, m) = (u64::from(layout.interleave()), u64::from(layout.ranks()));
    let start = position * PAGE;
    let end = (start + PAGE).min(end_token);
    if start >= end {
        return;
    }
    if PAGE / i + 2 <= m {
        let mut t = start;
        while t < end {
            let group_end = ((t / i) + 1).saturating_mul(i).min(end);
            rows[layout.place(t).rank as usize] += group_end - t;
            t = group_end;
        }
    } else {
        for (d, r) in (0u32..).zip(rows.iter_mut()) {
            *r += layout.tokens_on(d, end) - layout.tokens_on(d, start);
        }
    }
}

impl std::fmt::Display for DecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.chunk;
        write!(
            f,
            "request {} rank {}/{} chunk {} tokens [{}, {}){} into {}: kv {} of pages {}..{}, state {} of pages {}..{}, {} to {} decode ranks",
            self.request,
            self.rank,
            self.placement.shard(),
            c.index,
            c.start,
            c.end,
            if c.last { " final" } else { "" },
            self.layout,
            self.kv.entries.len(),
            self.kv.positions.start,
            self.kv.positions.end,
            self.state.entries.len(),
            self.state.positions.start,
            self.state.positions.end,
            self.bytes(),
            self.decode_ranks_reached()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The per-residue count of whole pages gives every rank the rows a token-by-token count
        /// does, for any layout (periods of 1 to over 1,000 pages), any set of pages and end.
        #[test]
        fn rows_per_rank_counts_every_token_once(
            m in 1u32..=8,
            interleave in prop_oneof![1u32..=130, Just(64), Just(128), Just(4096)],
            mut positions in proptest::collection::vec(0u64..3000, 0..300),
            end_token in 0u64..200_000,
        ) {
            positions.sort_unstable();
            positions.dedup();
            let layout = DecodeLayout::new(m, interleave).unwrap();
            let entries: Vec<(LocalPage, u64)> =
                positions.iter().map(|&p| (LocalPage(1), p)).collect();
            let mut want = vec![0u64; m as usize];
            for &p in &positions {
                for t in p * PAGE..((p + 1) * PAGE).min(end_token) {
                    want[layout.place(t).rank as usize] += 1;
                }
            }
            prop_assert_eq!(rows_per_rank(layout, &entries, end_token), want);
        }
    }
}
