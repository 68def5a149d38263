//! Building a [`SendPlan`]: source and destination pages paired by logical page position,
//! filtered to this rank's positions, resolved to its local pages and coalesced into runs, after
//! both sides' layouts and every page of the chunk were checked (module docs of [`super`]). Apart
//! from the plan's data so that what is checked, and in which order, reads in one place.

use super::{
    ChunkRange, PoolLayout, PrefillRank, Registration, Section, SectionComponent, SendPlan,
};
use crate::copy::OwnedRuns;
use crate::error::{Error, Result};
use crate::geometry::{ComponentLayout, PAGE_SIZE};
use crate::index::LogicalPage;
use crate::shard::Placement;

/// Checks both sides store the same cache the same packed way, naming the request; returns the
/// cache's components (what the plan then walks).
pub(super) fn check_layouts(
    request: u64,
    src: &PoolLayout,
    dst: &PoolLayout,
) -> Result<Vec<ComponentLayout>> {
    src.geometry
        .validate_pd(&dst.geometry)
        .map_err(|e| match e {
            Error::GeometryMismatch {
                what,
                expected,
                got,
            } => Error::GeometryMismatch {
                what: format!("request {request}: {what}"),
                expected,
                got,
            },
            other => Error::Transfer {
                request,
                reason: other.to_string(),
            },
        })?;
    let components = src.geometry.components();
    for (side, layout) in [("prefill", src), ("decode", dst)] {
        if layout.page_strides.len() != components.len() {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "the {side} side registered {} page strides for {} components",
                    layout.page_strides.len(),
                    components.len()
                ),
            });
        }
    }
    for (i, c) in components.iter().enumerate() {
        let (s, d) = (src.page_strides[i], dst.page_strides[i]);
        if s != c.block_bytes as u64 || d != c.block_bytes as u64 {
            return Err(Error::Transfer {
                request,
                reason: format!(
                    "packed page stride mismatch for {}: prefill {s} B, decode {d} B \
                     (both must store packed {} B blocks)",
                    c.component, c.block_bytes
                ),
            });
        }
        // Descriptor offsets are byte offsets inside a layer: a layer must fit them.
        for (side, layout) in [("prefill", src), ("decode", dst)] {
            if layout.pages.checked_mul(c.block_bytes as u64).is_none() {
                return Err(Error::Transfer {
                    request,
                    reason: format!(
                        "the {side} side registered {} pages of {} B {} blocks: more bytes than a layer can address",
                        layout.pages, c.block_bytes, c.component
                    ),
                });
            }
        }
    }
    Ok(components)
}

/// Checks every source page of a section (owned or not, so all ranks refuse the same chunk):
/// in the prefill group's logical range and not reserved.
pub(super) fn check_sources(
    request: u64,
    placement: Placement,
    src_logical: u64,
    first: usize,
    src: &[LogicalPage],
) -> Result<()> {
    let bad = src
        .iter()
        .enumerate()
        .find(|(_, s)| placement.is_reserved(**s) || s.0 >= src_logical);
    let Some((i, s)) = bad else {
        return Ok(());
    };
    let position = first + i;
    let reason = if placement.is_reserved(*s) {
        format!(
            "source page {} at position {position} is reserved (logical pages 0..{} are padding)",
            s.0,
            placement.shard()
        )
    } else {
        format!(
            "source page {} at position {position} out of range (the prefill group holds {src_logical} logical pages)",
            s.0
        )
    };
    Err(Error::Transfer { request, reason })
}

/// The pages chunk `chunk` of `registration` covers: its first page, the page past the last it
/// sends (a non-final chunk sends only the pages it completed), and the sequence's pages so far;
/// checked against the decode's cached prefix and registered pages.
fn chunk_pages(registration: &Registration, chunk: ChunkRange) -> Result<(usize, usize, usize)> {
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
    let seq_pages = chunk.end.div_ceil(PAGE_SIZE);
    // A non-final chunk sends only the pages it completed; the final one sends the rest.
    let end_page = if chunk.last {
        seq_pages
    } else {
        chunk.end / PAGE_SIZE
    }
    .max(start_page);
    // Fits: validate() checked the registered pages (in tokens) fit a usize.
    let registered = prefix + registration.pages.len();
    if chunk.last && seq_pages != registered {
        return fail(format!(
            "kv page count mismatch: the sequence of {} tokens has {seq_pages} pages, the decode registered {registered} ({prefix} cached + {} to receive)",
            chunk.end,
            registration.pages.len()
        ));
    }
    if end_page > registered {
        return fail(format!(
            "chunk {index} ends at page {end_page}, past the {registered} pages the decode registered ({prefix} cached + {} to receive)",
            registration.pages.len()
        ));
    }
    Ok((start_page, end_page, seq_pages))
}

impl SendPlan {
    /// Plans chunk `chunk` of `registration`'s request for `source`. `src_pages` is the prefill
    /// request's logical page of every sequence position so far (its `req_to_token`, by page).
    pub fn new(
        source: &PrefillRank,
        src_pages: &[LogicalPage],
        registration: &Registration,
        chunk: ChunkRange,
    ) -> Result<Self> {
        registration.validate()?;
        Self::of_valid(source, src_pages, registration, chunk)
    }

    /// [`SendPlan::new`] for a registration [`Registration::validate`] has accepted (a
    /// [`Sender`](super::Sender) validates each registration once, when it is opened, not for
    /// every chunk).
    pub(crate) fn of_valid(
        source: &PrefillRank,
        src_pages: &[LogicalPage],
        registration: &Registration,
        chunk: ChunkRange,
    ) -> Result<Self> {
        let request = registration.request;
        let fail = |reason: String| Err(Error::Transfer { request, reason });
        let (placement, rank) = (source.placement, source.rank);
        let shard = placement.shard();
        if rank >= shard {
            return fail(format!("prefill rank {rank} of a shard group of {shard}"));
        }
        let components = check_layouts(request, &source.layout, &registration.layout)?;
        let index = chunk.index;
        let (start_page, end_page, seq_pages) = chunk_pages(registration, chunk)?;
        let prefix = registration.prefix_pages;
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
            if registration.state_pages.len() != seq_pages {
                return fail(format!(
                    "state page count mismatch: the prefill sends {seq_pages} state pages (positions 0..{seq_pages}), the decode registered {}",
                    registration.state_pages.len()
                ));
            }
            seq_pages
        };
        // A chunk that completes no page past the prefix reads no source page.
        let kv_needed = if end_page > start_page { end_page } else { 0 };
        let needed = kv_needed.max(state_pages);
        if src_pages.len() < needed {
            return fail(format!(
                "the prefill page table holds {} pages, chunk {index} needs {needed}",
                src_pages.len()
            ));
        }
        let src_logical = placement.logical_pages(source.layout.pages)?;
        // In bounds: the page table holds `needed` pages and the decode registered
        // `registered - prefix` pages after its prefix and `state_pages` state pages.
        let (kv_src, kv_dst) = if end_page > start_page {
            (
                &src_pages[start_page..end_page],
                &registration.pages[start_page - prefix..end_page - prefix],
            )
        } else {
            (&[][..], &[][..])
        };
        check_sources(request, placement, src_logical, start_page, kv_src)?;
        let state_src = &src_pages[..state_pages];
        check_sources(request, placement, src_logical, 0, state_src)?;
        let kv = Section {
            positions: start_page..end_page,
            components: section(false),
            owned: OwnedRuns::new(placement, rank, kv_src, kv_dst, |d| d),
        };
        let state = Section {
            positions: 0..state_pages,
            components: state_components,
            owned: OwnedRuns::new(
                placement,
                rank,
                state_src,
                &registration.state_pages[..state_pages],
                |d| d,
            ),
        };
        Ok(Self {
            request,
            placement,
            rank,
            chunk,
            kv,
            state,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::Descriptor;
    use super::*;
    use crate::copy::Run;
    use crate::geometry::Component;
    use crate::geometry::{CacheGeometry, LatentLayout, PoolGeometry, INDEXER_PAGE_BYTES};
    use crate::index::LocalPage;

    const LATENT: u64 = 36_864;
    const INDEXER: u64 = INDEXER_PAGE_BYTES as u64;

    fn geometry() -> CacheGeometry {
        CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Trtllm,
            vec![true, false, true],
        ))
    }

    fn source(n: u32, rank: u32) -> PrefillRank {
        PrefillRank {
            placement: Placement::new(n).unwrap(),
            rank,
            layout: PoolLayout::packed(geometry(), 100),
        }
    }

    fn registration(prefix: usize, pages: Vec<u64>, state_pages: Vec<u64>) -> Registration {
        Registration {
            request: 7,
            layout: PoolLayout::packed(geometry(), 1000),
            prefix_pages: prefix,
            pages: pages.into_iter().map(LocalPage).collect(),
            state_pages: state_pages.into_iter().map(LocalPage).collect(),
        }
    }

    fn lp(pages: &[u64]) -> Vec<LogicalPage> {
        pages.iter().map(|&p| LogicalPage(p)).collect()
    }

    fn chunk(index: u32, start: usize, end: usize, last: bool) -> ChunkRange {
        ChunkRange {
            index,
            start,
            end,
            last,
        }
    }

    fn run(src: u64, dst: u64, pages: u64) -> Run {
        Run {
            src: LocalPage(src),
            dst: LocalPage(dst),
            pages,
        }
    }

    #[test]
    fn pairs_by_position_then_filters_then_resolves_and_coalesces() {
        // N = 2, rank 1 owns the odd logical pages. Positions 0..6:
        let src = [11, 13, 15, 4, 17, 19];
        let dst = vec![100, 101, 102, 103, 104, 105];
        // Owned: positions 0,1,2 (local 5,6,7 -> dst 100,101,102: one run), 4,5 (local 8,9 ->
        // dst 104,105: one run, because the local pages continue but the destination jumps).
        let plan = SendPlan::new(
            &source(2, 1),
            &lp(&src),
            &registration(0, dst.clone(), dst),
            chunk(0, 0, 6 * 64, true),
        )
        .unwrap();
        assert_eq!(plan.kv().positions(), 0..6);
        assert_eq!(plan.kv().runs(), [run(5, 100, 3), run(8, 104, 2)]);
        assert_eq!(plan.kv().owned_pages(), 5);
        // The state covers the same positions from 0 and pairs the same way.
        assert_eq!(plan.state().runs(), plan.kv().runs());
        // Latent: target (3 layers) then draft (1); state: target indexer (2 layers: layer 1
        // shares its indexer and is absent) then the draft's.
        let kv: Vec<_> = plan
            .kv()
            .components()
            .iter()
            .map(|c| (c.component, c.layers))
            .collect();
        assert_eq!(
            kv,
            vec![(Component::TargetLatent, 3), (Component::DraftLatent, 1)]
        );
        let state: Vec<_> = plan
            .state()
            .components()
            .iter()
            .map(|c| (c.component, c.layers, c.item))
            .collect();
        assert_eq!(
            state,
            vec![
                (Component::TargetIndexer, 2, INDEXER),
                (Component::DraftIndexer, 1, INDEXER)
            ]
        );
        assert_eq!(plan.descriptor_count(), 2 * 4 + 2 * 3);
        assert_eq!(plan.uncoalesced_count(), 5 * 4 + 5 * 3);
        let d: Vec<_> = plan.descriptors().collect();
        assert_eq!(d.len(), plan.descriptor_count());
        assert_eq!(
            d[0],
            Descriptor {
                component: Component::TargetLatent,
                layer: 0,
                src_offset: 5 * LATENT,
                dst_offset: 100 * LATENT,
                bytes: 3 * LATENT,
            }
        );
        assert_eq!((d[7].component, d[7].layer), (Component::DraftLatent, 0));
        assert_eq!(
            (d[8].component, d[8].layer, d[8].bytes),
            (Component::TargetIndexer, 0, 3 * INDEXER)
        );
        assert_eq!(d[13].component, Component::DraftIndexer);
        let bytes = plan.bytes();
        assert_eq!(bytes.get(Component::TargetLatent), 5 * 3 * LATENT);
        assert_eq!(bytes.get(Component::TargetIndexer), 5 * 2 * INDEXER);
        assert_eq!(bytes.get(Component::DraftLatent), 5 * LATENT);
        assert_eq!(
            bytes.total(),
            d.iter().map(|d| d.bytes).sum::<u64>(),
            "bytes match the descriptors"
        );
        let text = plan.to_string();
        assert!(
            text.contains("request 7 rank 1/2 chunk 0 tokens [0, 384) final")
                && text.contains("kv pages 0..6: 5 owned in 2 runs x 4 layers")
                && text.contains("14 descriptors (35 before coalescing)"),
            "{text}"
        );
    }

    #[test]
    fn non_final_chunks_floor_to_pages_and_carry_no_state() {
        let src: Vec<u64> = (0..10).map(|p| 4 + p).collect();
        let dst: Vec<u64> = (0..8).map(|p| 50 + p).collect();
        let state: Vec<u64> = (0..10).map(|p| 48 + p).collect();
        let reg = registration(2, dst, state);
        // Tokens [128, 300): pages 2, 3 complete; page 4 (tokens 256..320) waits.
        let plan =
            SendPlan::new(&source(1, 0), &lp(&src), &reg, chunk(0, 128, 300, false)).unwrap();
        assert_eq!(plan.kv().positions(), 2..4);
        assert_eq!(plan.kv().runs(), [run(6, 50, 2)]);
        assert!(plan.state().components().is_empty() && plan.state().runs().is_empty());
        // A chunk that completes no page is empty but valid.
        let plan =
            SendPlan::new(&source(1, 0), &lp(&src), &reg, chunk(1, 256, 300, false)).unwrap();
        assert!(plan.is_empty() && plan.kv().positions() == (4..4));
        // The final chunk sends the partial page and the state from position 0.
        let plan = SendPlan::new(&source(1, 0), &lp(&src), &reg, chunk(1, 256, 600, true)).unwrap();
        assert_eq!(plan.kv().positions(), 4..10);
        assert_eq!(plan.kv().runs(), [run(8, 52, 6)]);
        assert_eq!(plan.state().positions(), 0..10);
        assert_eq!(plan.state().runs(), [run(4, 48, 10)]);
    }

    #[test]
    fn a_rank_owning_nothing_gets_an_empty_final_plan() {
        // Three pages, N = 8: ranks owning none of 9, 10, 11 send nothing, state included.
        let src = [9, 10, 11];
        let reg = registration(0, vec![1, 2, 3], vec![1, 2, 3]);
        for rank in 0..8 {
            let plan =
                SendPlan::new(&source(8, rank), &lp(&src), &reg, chunk(0, 0, 150, true)).unwrap();
            assert_eq!(plan.is_empty(), !(1..=3).contains(&rank), "rank {rank}");
            assert_eq!(plan.bytes().total() == 0, plan.is_empty());
        }
    }

    #[test]
    fn all_shared_indexers_and_no_draft_send_no_state() {
        let g = CacheGeometry::target_only(PoolGeometry::with_indexer_layers(
            LatentLayout::Fp8Scaled,
            vec![false; 2],
        ));
        let src = PrefillRank {
            placement: Placement::unsharded(),
            rank: 0,
            layout: PoolLayout::packed(g.clone(), 10),
        };
        let reg = Registration {
            request: 1,
            layout: PoolLayout::packed(g, 10),
            prefix_pages: 0,
            pages: vec![LocalPage(3), LocalPage(4)],
            // Nothing to check the state against: there is none.
            state_pages: Vec::new(),
        };
        let plan = SendPlan::new(&src, &lp(&[1, 2]), &reg, chunk(0, 0, 128, true)).unwrap();
        assert!(plan.state().components().is_empty());
        assert_eq!(plan.descriptor_count(), 2);
        assert_eq!(plan.kv().runs(), [run(1, 3, 2)]);
    }

    fn err(plan: Result<SendPlan>) -> String {
        plan.unwrap_err().to_string()
    }

    #[test]
    fn validation_names_the_request_and_the_numbers() {
        let src: Vec<u64> = (0..4).map(|p| 4 + p).collect();
        let good = registration(0, vec![1, 2, 3, 4], vec![1, 2, 3, 4]);
        let last = chunk(0, 0, 256, true);
        let s = source(2, 0);
        assert!(SendPlan::new(&s, &lp(&src), &good, last).is_ok());

        let mut no_draft = good.clone();
        no_draft.layout = PoolLayout::packed(CacheGeometry::target_only(geometry().target), 1000);
        let e = SendPlan::new(&s, &lp(&src), &no_draft, last).unwrap_err();
        assert!(matches!(e, Error::GeometryMismatch { .. }), "{e}");
        assert!(e
            .to_string()
            .contains("request 7: prefill vs decode: draft pool present"));

        let mut stride = good.clone();
        stride.layout.page_strides[1] = 8192;
        let m = err(SendPlan::new(&s, &lp(&src), &stride, last));
        assert!(
            m.contains("request 7: packed page stride mismatch for target indexer: prefill 8448 B, decode 8192 B"),
            "{m}"
        );

        let mut state = good.clone();
        state.state_pages.pop();
        let m = err(SendPlan::new(&s, &lp(&src), &state, last));
        assert!(
            m.contains("request 7: state page count mismatch: the prefill sends 4 state pages")
                && m.contains("the decode registered 3"),
            "{m}"
        );

        let mut kv = good.clone();
        kv.pages.push(LocalPage(9));
        let m = err(SendPlan::new(&s, &lp(&src), &kv, last));
        assert!(
            m.contains("kv page count mismatch") && m.contains("registered 5 (0 cached + 5"),
            "{m}"
        );

        let mut far = good.clone();
        far.pages[2] = LocalPage(1000);
        let m = err(SendPlan::new(&s, &lp(&src), &far, last));
        assert!(
            m.contains("destination page 1000 at position 2 out of range (the decode pool holds 1000 pages)"),
            "{m}"
        );
        let mut padding = good.clone();
        padding.state_pages[3] = LocalPage(0);
        let m = err(SendPlan::new(&s, &lp(&src), &padding, last));
        assert!(m.contains("destination state page 0 at position 3"), "{m}");

        let m = err(SendPlan::new(&s, &lp(&[4, 5, 1, 7]), &good, last));
        assert!(m.contains("source page 1 at position 2 is reserved"), "{m}");
        let m = err(SendPlan::new(&s, &lp(&[4, 5, 200, 7]), &good, last));
        assert!(
            m.contains("source page 200 at position 2 out of range (the prefill group holds 200 logical pages)"),
            "{m}"
        );
        let m = err(SendPlan::new(&s, &lp(&src[..3]), &good, last));
        assert!(
            m.contains("page table holds 3 pages, chunk 0 needs 4"),
            "{m}"
        );

        let m = err(SendPlan::new(
            &s,
            &lp(&src),
            &good,
            chunk(2, 100, 256, true),
        ));
        assert!(
            m.contains("chunk 2 starts at token 100, not a page boundary"),
            "{m}"
        );
        let cached = registration(2, vec![3, 4], vec![1, 2, 3, 4]);
        let m = err(SendPlan::new(
            &s,
            &lp(&src),
            &cached,
            chunk(0, 64, 256, true),
        ));
        assert!(
            m.contains("inside the decode's cached prefix of 2 pages"),
            "{m}"
        );
        let m = err(SendPlan::new(
            &s,
            &lp(&src),
            &cached,
            chunk(0, 128, 1000, false),
        ));
        assert!(
            m.contains("chunk 0 ends at page 15, past the 4 pages"),
            "{m}"
        );
        let m = err(SendPlan::new(&source(2, 2), &lp(&src), &good, last));
        assert!(m.contains("prefill rank 2 of a shard group of 2"), "{m}");
    }
}
