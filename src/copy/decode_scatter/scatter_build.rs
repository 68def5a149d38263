//! Building a plan: the checks in order, the pairs (every layer of every component moved),
//! the entries as the kernel reads them, the bytes moved.

use super::super::space::BlockSpace;
use super::checks::{check_entries, check_targets, check_written_disjoint, row_formats};
use super::{DecodeScatterPlan, Mode, ScatterSection, Targets};
use crate::abi;
use crate::error::{Checked, Error, Result};
use crate::geometry::ComponentLayout;
use crate::shard::DecodeLayout;

impl DecodeScatterPlan {
    /// Everything the constructors share: the checks of the module docs, the tables.
    pub(super) fn build(
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
        layout: DecodeLayout,
        end_token: u64,
        [kv, state]: [ScatterSection; 2],
        mode: Mode,
        targets: Targets,
    ) -> Result<Self> {
        if let Targets::One(rank, _) = targets {
            layout.check_rank(rank)?;
        }
        check_targets(dsts, layout, end_token, &targets)?;
        let components = row_formats(src, dsts)?;
        let src_limit = src.pages();
        check_entries(src_limit, [&kv, &state], mode)?;
        let (pairs, dst_bases, kv_pairs) = Self::pairs(src, dsts, &kv, &state)?;
        let positions = [moved_positions(&kv), moved_positions(&state)];
        let (ranks, shifts, rows, dense) = Self::ranks(
            src_limit, dsts, layout, end_token, &positions, mode, &targets,
        )?;
        check_written_disjoint(src, dsts, &pairs, &kv, &targets, &ranks, &dense)?;
        let bytes = moved_bytes(src.components(), &components, rows, [&kv, &state])?;
        Ok(Self {
            src: (src.id(), src.address_space()),
            dsts: dsts.iter().map(|d| (d.id(), d.address_space())).collect(),
            layout,
            end_token,
            src_limit,
            mode,
            one_rank: match targets {
                Targets::One(rank, _) => Some(rank),
                Targets::Every(_) | Targets::Dense => None,
            },
            components,
            kv_pairs,
            dst_bases,
            ranks,
            entries: kernel_entries(&kv),
            state_entries: kernel_entries(&state),
            shifts,
            pairs,
            bytes,
        })
    }

    /// The pairs (the latent section's components, then the state section's, every stored
    /// layer), the destinations' bases of each, and how many are the latent section's.
    fn pairs(
        src: &dyn BlockSpace,
        dsts: &[&dyn BlockSpace],
        kv: &ScatterSection,
        state: &ScatterSection,
    ) -> Result<(Vec<abi::kvs_decode_pair>, Vec<u64>, usize)> {
        let mut pairs = Vec::new();
        let mut dst_bases = Vec::new();
        let mut kv_pairs = 0;
        let mut moved = Vec::new();
        for (section, is_kv) in [(kv, true), (state, false)] {
            for &component in &section.components {
                if moved.contains(&component) {
                    return Err(Error::InvalidArgument(format!(
                        "a scatter moves {component} twice"
                    )));
                }
                moved.push(component);
                let c = src.component_index(component)?;
                let layers = src.layer_count(c);
                pairs.reserve(layers);
                dst_bases.reserve(layers * dsts.len());
                for layer in 0..layers {
                    pairs.push(abi::kvs_decode_pair {
                        src: src.base(c, layer),
                        component: c as u32,
                        reserved: 0,
                    });
                    dst_bases.extend(dsts.iter().map(|d| d.base(c, layer)));
                    kv_pairs += usize::from(is_kv);
                }
            }
        }
        u32::try_from(pairs.len())
            .map_err(|_| Error::overflow(format!("{} scatter pairs", pairs.len())))?;
        Ok((pairs, dst_bases, kv_pairs))
    }
}

/// Bytes the scatter moves: `rows` of each section, a row of every component and layer of it.
pub(super) fn moved_bytes(
    layouts: &[ComponentLayout],
    components: &[abi::kvs_row_component],
    rows: [u64; 2],
    [kv, state]: [&ScatterSection; 2],
) -> Result<u64> {
    let row_bytes = |section: &ScatterSection| -> u64 {
        section
            .components
            .iter()
            .filter_map(|&c| layouts.iter().position(|l| l.component == c))
            .map(|c| u64::from(components[c].row_bytes) * layouts[c].layers() as u64)
            .sum()
    };
    let what = || "bytes of a scatter".to_string();
    rows[0]
        .mul_or(row_bytes(kv), what)?
        .add_or(rows[1].mul_or(row_bytes(state), what)?, what)
}

/// The entries of a section as the kernel reads them (none when it moves no component).
fn kernel_entries(section: &ScatterSection) -> Vec<abi::kvs_decode_entry> {
    if section.components.is_empty() {
        return Vec::new();
    }
    section
        .entries
        .iter()
        .map(|&(page, position)| abi::kvs_decode_entry {
            // Below the source's page count (checked; an unpack's are never read), itself far
            // below 2^63.
            page: i64::try_from(page.0).unwrap_or(i64::MAX),
            position,
        })
        .collect()
}

/// The sequence pages a section moves (none when it moves no component).
fn moved_positions(section: &ScatterSection) -> Vec<u64> {
    if section.components.is_empty() {
        Vec::new()
    } else {
        section.positions()
    }
}
