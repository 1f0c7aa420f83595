//! Shadow cells: how the verifier cuts a buffer into the pieces it tracks.
//!
//! Every access of a plan is a region, and almost every region is a rectangle of its
//! buffer (a set of whole rows of one column range). Cutting each buffer at every
//! region's first and last row and column gives cells that every access covers whole or
//! not at all, so one shadow entry per cell says what one per element would: the same
//! findings, at the same first element. The cost then follows the plan's structure (its
//! devices, slots and chunks), not M, N and K, and a plan at production sizes verifies as
//! fast as one at test sizes.
//!
//! A region that is not such a rectangle (a row stride that is not a multiple of the
//! buffer's columns, a row that wraps into the next) makes its buffer fall back to one
//! cell per element.

use std::ops::Range;

use crate::plan::{BufferDecl, Plan, Region};

use super::accesses;

/// The most row or column cuts one buffer may collect, repeats included, before they are
/// deduplicated; past half as many distinct ones it falls back to one cell per element
/// (whose size [`super::check_size`] then judges). It bounds the memory a plan file of
/// many finely strided regions can make the grid take.
const MAX_CUTS: usize = 1 << 24;

/// How one buffer is cut into cells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Grid {
    /// One cell per element, numbered as the elements.
    Elements {
        /// The buffer's columns (its row stride).
        cols: usize,
        /// Its elements.
        len: usize,
    },
    /// Row bands × column bands, numbered row-major, between sorted cuts (the first cut
    /// is 0, the last the buffer's rows or columns).
    Bands {
        /// Row cuts.
        rows: Vec<usize>,
        /// Column cuts.
        cols: Vec<usize>,
    },
}

/// A region as its buffer's rows `first + i·step` (i < `count`, all inside the buffer)
/// over the columns `cols`.
struct RowSet {
    first: usize,
    step: usize,
    count: usize,
    cols: Range<usize>,
}

impl RowSet {
    /// The region as rows of one column range of `b`, or `None` when it is not one.
    /// Rows past the buffer are dropped (the plan validator reports them).
    fn of(region: &Region, b: &BufferDecl) -> Option<RowSet> {
        let width = b.cols;
        if width == 0 {
            return None;
        }
        let (first, c0) = (region.offset / width, region.offset % width);
        if c0.checked_add(region.cols)? > width {
            return None;
        }
        let step = if region.rows == 1 {
            1
        } else if region.stride > 0 && region.stride % width == 0 {
            region.stride / width
        } else {
            return None;
        };
        let inside = b.rows.saturating_sub(first).div_ceil(step);
        Some(RowSet { first, step, count: region.rows.min(inside), cols: c0..c0 + region.cols })
    }

    fn rows(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.count).map(|i| self.first + i * self.step)
    }
}

fn sort_dedup(cuts: &mut Vec<usize>) {
    cuts.sort_unstable();
    cuts.dedup();
}

/// Index of `value` in sorted `cuts` (it is one of them by construction).
fn band(cuts: &[usize], value: usize) -> usize {
    cuts.partition_point(|&c| c < value)
}

impl Grid {
    /// One cell per element of `b`.
    fn elements(b: &BufferDecl) -> Grid {
        Grid::Elements { cols: b.cols, len: b.len() }
    }

    /// The grid of every buffer that every access of every plan in `plans` covers whole
    /// (the plans must declare the same buffers), in one pass over their ops.
    fn all(plans: &[&Plan]) -> Vec<Grid> {
        let buffers = &plans[0].buffers;
        // Per buffer: its row and column cuts, or None once it needs a cell per element.
        // An uneven shard is cut where each device's rows end, so that no cell holds both
        // a device's rows and its padding.
        let mut cuts: Vec<Option<(Vec<usize>, Vec<usize>)>> = buffers
            .iter()
            .map(|b| {
                let mut rows = vec![0, b.rows];
                rows.extend(b.device_rows.iter().flatten());
                Some((rows, vec![0, b.cols]))
            })
            .collect();
        for plan in plans {
            for (site, op) in plan.ops() {
                for acc in accesses(site.device, op) {
                    let (r, b) = (&acc.region, &buffers[acc.region.buf.0]);
                    if r.is_empty() || cuts[r.buf.0].is_none() {
                        continue;
                    }
                    let Some(set) = RowSet::of(r, b) else {
                        cuts[r.buf.0] = None;
                        continue;
                    };
                    let Some((rows, cols)) = cuts[r.buf.0].as_mut().filter(|_| set.count > 0) else { continue };
                    if set.step == 1 {
                        rows.extend([set.first, set.first + set.count]);
                    } else {
                        rows.extend(set.rows().flat_map(|r| [r, r + 1]));
                    }
                    cols.extend([set.cols.start, set.cols.end]);
                    // Most cuts repeat: drop the repeats before judging the size.
                    if rows.len() > MAX_CUTS || cols.len() > MAX_CUTS {
                        sort_dedup(rows);
                        sort_dedup(cols);
                        if rows.len() > MAX_CUTS / 2 || cols.len() > MAX_CUTS / 2 {
                            cuts[r.buf.0] = None;
                        }
                    }
                }
            }
        }
        buffers
            .iter()
            .zip(cuts)
            .map(|(b, cuts)| match cuts {
                Some((mut rows, mut cols)) => {
                    sort_dedup(&mut rows);
                    sort_dedup(&mut cols);
                    Grid::Bands { rows, cols }
                }
                None => Grid::elements(b),
            })
            .collect()
    }

    /// How many cells.
    pub(crate) fn len(&self) -> usize {
        match self {
            Grid::Elements { len, .. } => *len,
            Grid::Bands { rows, cols } => (rows.len() - 1).saturating_mul(cols.len() - 1),
        }
    }

    /// The first element (row, column) of a cell.
    pub(crate) fn element(&self, cell: usize) -> (usize, usize) {
        match self {
            Grid::Elements { cols, .. } => (cell / (*cols).max(1), cell % (*cols).max(1)),
            Grid::Bands { rows, cols } => {
                let n = cols.len() - 1;
                (rows[cell / n], cols[cell % n])
            }
        }
    }

    /// How many elements a cell holds.
    pub(crate) fn weight(&self, cell: usize) -> usize {
        match self {
            Grid::Elements { .. } => 1,
            Grid::Bands { rows, cols } => {
                let n = cols.len() - 1;
                let (i, j) = (cell / n, cell % n);
                (rows[i + 1] - rows[i]) * (cols[j + 1] - cols[j])
            }
        }
    }

    /// The cells of `region`, as runs of consecutive cell numbers in the order of its
    /// elements (row by row). Elements past the buffer are left out.
    pub(crate) fn runs(&self, region: &Region, b: &BufferDecl) -> Vec<Range<usize>> {
        if region.is_empty() {
            return Vec::new();
        }
        match self {
            Grid::Elements { len, .. } => (0..region.rows)
                .map(|r| {
                    let row0 = region.offset.saturating_add(r.saturating_mul(region.stride));
                    let to = row0.saturating_add(region.cols).min(*len);
                    row0.min(to)..to
                })
                .collect(),
            Grid::Bands { rows, cols } => {
                // A region of a `Bands` buffer is a row set by construction.
                let Some(set) = RowSet::of(region, b) else { return Vec::new() };
                let n = cols.len() - 1;
                let (c0, c1) = (band(cols, set.cols.start), band(cols, set.cols.end));
                let line = |i: usize| i * n + c0..i * n + c1;
                if set.step == 1 {
                    (band(rows, set.first)..band(rows, set.first + set.count)).map(line).collect()
                } else {
                    set.rows().map(|r| line(band(rows, r))).collect()
                }
            }
        }
    }
}

/// The grids of every buffer of a plan, or the common grids of plans that declare the
/// same buffers (so that per-cell facts about them compare cell by cell).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cells {
    pub(crate) grids: Vec<Grid>,
}

impl Cells {
    /// Cells that every access of `plan` covers whole or not at all.
    pub fn of(plan: &Plan) -> Cells {
        Cells::common(&[plan]).expect("one plan declares its own buffers")
    }

    /// Cells that every access of every plan covers whole or not at all; `None` when the
    /// plans declare different buffers.
    pub fn common(plans: &[&Plan]) -> Option<Cells> {
        let first = plans.first()?;
        if plans.iter().any(|p| p.buffers != first.buffers) {
            return None;
        }
        Some(Cells { grids: Grid::all(plans) })
    }

    /// One cell per element of every buffer: the verifier's definition, which the cells
    /// of [`Cells::of`] must agree with.
    pub fn per_element(plan: &Plan) -> Cells {
        Cells { grids: plan.buffers.iter().map(Grid::elements).collect() }
    }

    /// Cells per device (every device has every buffer).
    pub fn per_device(&self) -> u64 {
        self.grids.iter().fold(0u64, |sum, g| sum.saturating_add(g.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{BufferRole, PlanBuilder};
    use crate::DType;

    fn buffer(rows: usize, cols: usize) -> BufferDecl {
        BufferDecl { name: "X".into(), dtype: DType::F32, rows, cols, role: BufferRole::Scratch, device_rows: None }
    }

    fn region(offset: usize, rows: usize, cols: usize, stride: usize) -> Region {
        Region { buf: crate::plan::BufId(0), offset, rows, cols, stride }
    }

    #[test]
    fn a_rectangle_is_cut_at_its_edges_and_walked_in_element_order() {
        let b = buffer(6, 8);
        let grid = Grid::Bands { rows: vec![0, 2, 5, 6], cols: vec![0, 3, 8] };
        assert_eq!(grid.len(), 6);
        // Rows 2..5, columns 3..8: one cell, band 1 × band 1.
        assert_eq!(grid.runs(&region(2 * 8 + 3, 3, 5, 8), &b), vec![3..4]);
        // Rows 0..5, all columns: two bands of two cells.
        assert_eq!(grid.runs(&region(0, 5, 8, 8), &b), vec![0..2, 2..4]);
        assert_eq!((grid.element(3), grid.weight(3)), ((2, 3), 15));
        assert_eq!((grid.element(5), grid.weight(5)), ((5, 3), 5));
    }

    #[test]
    fn strided_rows_get_a_band_each_and_irregular_regions_fall_back_to_elements() {
        let mut p = PlanBuilder::new("cells", 1);
        let x = p.buffer("X", DType::F32, 8, 4, BufferRole::Scratch);
        let y = p.buffer("Y", DType::F32, 8, 4, BufferRole::Scratch);
        let lane = p.lane("l");
        // Every other row of X (stride 2 rows), columns 1..3; Y with a stride of 6.
        p.push(
            0,
            lane,
            crate::plan::Op::Copy {
                src: Region { buf: x, offset: 1, rows: 4, cols: 2, stride: 8 },
                dst_device: 0,
                dst: Region { buf: y, offset: 0, rows: 4, cols: 2, stride: 6 },
                engine: crate::plan::Engine::CopyEngine,
            },
        );
        let plan = p.finish().unwrap();
        let cells = Cells::of(&plan);
        assert_eq!(cells.grids[0], Grid::Bands { rows: (0..=8).collect(), cols: vec![0, 1, 3, 4] });
        assert_eq!(cells.grids[0].runs(&region(1, 4, 2, 8), &plan.buffers[0]), vec![1..2, 7..8, 13..14, 19..20]);
        assert_eq!(cells.grids[1], Grid::Elements { cols: 4, len: 32 });
        assert_eq!(cells.grids[1].runs(&region(0, 2, 2, 6), &plan.buffers[1]), vec![0..2, 6..8]);
        assert_eq!(cells.per_device(), 8 * 3 + 32);
    }

    #[test]
    fn rows_past_the_buffer_are_left_out() {
        let b = buffer(4, 4);
        let set = RowSet::of(&region(8, 5, 4, 4), &b).unwrap();
        assert_eq!((set.first, set.count), (2, 2));
        let set = RowSet::of(&region(4, 5, 4, 8), &b).unwrap();
        assert_eq!((set.first, set.step, set.count), (1, 2, 2));
        assert_eq!(RowSet::of(&region(20, 1, 4, 4), &b).unwrap().count, 0);
        // A row that would wrap into the next is not a row set.
        assert!(RowSet::of(&region(2, 1, 4, 4), &b).is_none());
    }
}
