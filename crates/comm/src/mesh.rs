//! DeviceMesh: world ranks laid out on named axes, with one sub-group per axis.
//!
//! The layout is row-major in the order the axes are given: the last axis varies
//! fastest. With `[(Dp, 2), (Tp, 2)]`, ranks 0 and 1 form a tensor-parallel pair (put
//! the most communication-heavy axis last so its ranks are neighbours), and ranks 0
//! and 2 form a data-parallel pair. Axes not listed have size 1.

use crate::error::{fmt_ranks, CommError};
use crate::group::ProcessGroup;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// A named parallelism dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MeshAxis {
    /// Data parallel.
    Dp,
    /// Pipeline parallel.
    Pp,
    /// Tensor parallel.
    Tp,
    /// Context (sequence) parallel.
    Cp,
}

impl MeshAxis {
    pub const ALL: [MeshAxis; 4] = [MeshAxis::Dp, MeshAxis::Pp, MeshAxis::Tp, MeshAxis::Cp];

    pub fn as_str(self) -> &'static str {
        match self {
            MeshAxis::Dp => "dp",
            MeshAxis::Pp => "pp",
            MeshAxis::Tp => "tp",
            MeshAxis::Cp => "cp",
        }
    }
}

impl fmt::Display for MeshAxis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MeshAxis {
    type Err = MeshError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MeshAxis::ALL
            .into_iter()
            .find(|a| a.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| MeshError::UnknownAxis(s.to_string()))
    }
}

/// Errors of mesh layouts.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("{expression} = {product} but the world has {world} workers")]
    SizeMismatch {
        /// e.g. `dp=2 × pp=3`
        expression: String,
        product: usize,
        world: usize,
    },
    #[error("mesh axis {0} has size 0; every axis needs at least one rank")]
    ZeroSize(MeshAxis),
    #[error("mesh axis {0} is listed more than once")]
    DuplicateAxis(MeshAxis),
    #[error("unknown mesh axis '{0}' (expected dp, pp, tp or cp)")]
    UnknownAxis(String),
    #[error("rank {rank} is outside a mesh of {world} ranks")]
    RankOutOfRange { rank: usize, world: usize },
    #[error("creating the mesh's sub-groups failed: {0}")]
    Comm(#[from] CommError),
}

/// The shape of a mesh: plain data, testable without any communication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshLayout {
    dims: Vec<(MeshAxis, usize)>,
}

impl MeshLayout {
    /// A layout with the given axes (slowest first). Rejects size-0 and repeated axes.
    pub fn new(dims: &[(MeshAxis, usize)]) -> Result<MeshLayout, MeshError> {
        for (i, &(axis, size)) in dims.iter().enumerate() {
            if size == 0 {
                return Err(MeshError::ZeroSize(axis));
            }
            if dims[..i].iter().any(|&(a, _)| a == axis) {
                return Err(MeshError::DuplicateAxis(axis));
            }
        }
        Ok(MeshLayout {
            dims: dims.to_vec(),
        })
    }

    /// The axes and their sizes, slowest first.
    pub fn dims(&self) -> &[(MeshAxis, usize)] {
        &self.dims
    }

    /// Product of all axis sizes.
    pub fn world_size(&self) -> usize {
        self.dims.iter().map(|&(_, s)| s).product()
    }

    /// Checks that the layout uses exactly `world` ranks.
    pub fn validate(&self, world: usize) -> Result<(), MeshError> {
        let product = self.world_size();
        if product == world {
            return Ok(());
        }
        let expression = if self.dims.is_empty() {
            "an empty mesh".to_string()
        } else {
            self.dims
                .iter()
                .map(|(a, s)| format!("{a}={s}"))
                .collect::<Vec<_>>()
                .join(" × ")
        };
        Err(MeshError::SizeMismatch {
            expression,
            product,
            world,
        })
    }

    /// Size of `axis` (1 if the layout does not use it).
    pub fn size(&self, axis: MeshAxis) -> usize {
        self.dims
            .iter()
            .find(|&&(a, _)| a == axis)
            .map_or(1, |&(_, s)| s)
    }

    fn check_rank(&self, rank: usize) -> Result<(), MeshError> {
        let world = self.world_size();
        if rank >= world {
            return Err(MeshError::RankOutOfRange { rank, world });
        }
        Ok(())
    }

    /// Coordinates of `rank`, one per axis in layout order.
    pub fn coords(&self, rank: usize) -> Result<Vec<usize>, MeshError> {
        self.check_rank(rank)?;
        let mut rest = rank;
        let mut coords = vec![0; self.dims.len()];
        for (i, &(_, size)) in self.dims.iter().enumerate().rev() {
            coords[i] = rest % size;
            rest /= size;
        }
        Ok(coords)
    }

    /// Coordinate of `rank` along `axis` (0 for an unused axis).
    pub fn coordinate(&self, rank: usize, axis: MeshAxis) -> Result<usize, MeshError> {
        let coords = self.coords(rank)?;
        Ok(self
            .dims
            .iter()
            .position(|&(a, _)| a == axis)
            .map_or(0, |i| coords[i]))
    }

    /// The ranks whose coordinates on every one of `axes` equal `rank`'s, in rank order: the
    /// members of a group spanning the other axes (the dp × cp group that shares pp and tp
    /// coordinates). [`MeshLayout::axis_ranks`] is the case of one free axis.
    pub fn ranks_sharing(&self, rank: usize, axes: &[MeshAxis]) -> Result<Vec<usize>, MeshError> {
        let on_axes = |r: usize| -> Result<Vec<usize>, MeshError> {
            axes.iter().map(|&a| self.coordinate(r, a)).collect()
        };
        let mine = on_axes(rank)?;
        let mut members = Vec::new();
        for r in 0..self.world_size() {
            if on_axes(r)? == mine {
                members.push(r);
            }
        }
        Ok(members)
    }

    /// The ranks that share every coordinate of `rank` except along `axis`, ordered
    /// by their coordinate on `axis`: the members of `rank`'s group along `axis`.
    pub fn axis_ranks(&self, rank: usize, axis: MeshAxis) -> Result<Vec<usize>, MeshError> {
        let coords = self.coords(rank)?;
        let Some(index) = self.dims.iter().position(|&(a, _)| a == axis) else {
            return Ok(vec![rank]);
        };
        let stride: usize = self.dims[index + 1..].iter().map(|&(_, s)| s).product();
        let base = rank - coords[index] * stride;
        Ok((0..self.dims[index].1).map(|c| base + c * stride).collect())
    }
}

/// A validated layout plus this rank's group along every axis.
pub struct DeviceMesh {
    layout: MeshLayout,
    world: Arc<dyn ProcessGroup>,
    groups: Vec<(MeshAxis, Arc<dyn ProcessGroup>)>,
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("layout", &self.layout)
            .field("rank", &self.world.rank())
            .finish()
    }
}

impl DeviceMesh {
    /// Lays the ranks of `world` out on `dims` and creates this rank's sub-group along
    /// each of the four axes (size-1 groups for unused axes). Every rank of `world`
    /// must call this with the same `dims`.
    pub fn new(
        world: Arc<dyn ProcessGroup>,
        dims: &[(MeshAxis, usize)],
    ) -> Result<DeviceMesh, MeshError> {
        let layout = MeshLayout::new(dims)?;
        layout.validate(world.size())?;
        let rank = world.rank();
        let mut groups = Vec::with_capacity(MeshAxis::ALL.len());
        for axis in MeshAxis::ALL {
            let members = layout.axis_ranks(rank, axis)?;
            let globals: Vec<usize> = members.iter().map(|&r| world.global_ranks()[r]).collect();
            let name = format!("{axis}{}", fmt_ranks(&globals).replace(' ', ""));
            let group = world.new_named_subgroup(&members, &name)?;
            groups.push((axis, group));
        }
        Ok(DeviceMesh {
            layout,
            world,
            groups,
        })
    }

    pub fn layout(&self) -> &MeshLayout {
        &self.layout
    }

    /// The group the mesh was built on.
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }

    /// This rank's group along `axis`.
    pub fn group(&self, axis: MeshAxis) -> &Arc<dyn ProcessGroup> {
        &self
            .groups
            .iter()
            .find(|(a, _)| *a == axis)
            .expect("DeviceMesh::new creates a group for every axis")
            .1
    }

    /// This rank's coordinate along `axis`.
    pub fn coordinate(&self, axis: MeshAxis) -> usize {
        self.group(axis).rank()
    }

    /// Size of `axis`.
    pub fn size(&self, axis: MeshAxis) -> usize {
        self.layout.size(axis)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MeshAxis::*;

    #[test]
    fn size_mismatch_message_names_the_product_and_world() {
        let layout = MeshLayout::new(&[(Dp, 2), (Pp, 3)]).unwrap();
        let err = layout.validate(4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "dp=2 × pp=3 = 6 but the world has 4 workers"
        );
        assert!(layout.validate(6).is_ok());
    }

    #[test]
    fn rejects_zero_and_duplicate_axes() {
        assert!(matches!(
            MeshLayout::new(&[(Dp, 0)]),
            Err(MeshError::ZeroSize(Dp))
        ));
        assert!(matches!(
            MeshLayout::new(&[(Tp, 2), (Tp, 2)]),
            Err(MeshError::DuplicateAxis(Tp))
        ));
        assert!(matches!(
            "xx".parse::<MeshAxis>(),
            Err(MeshError::UnknownAxis(_))
        ));
        assert_eq!("TP".parse::<MeshAxis>().unwrap(), Tp);
    }

    #[test]
    fn axis_groups_partition_the_world() {
        let layout = MeshLayout::new(&[(Dp, 2), (Pp, 3), (Tp, 2)]).unwrap();
        for axis in [Dp, Pp, Tp, Cp] {
            let mut seen = [0usize; 12];
            for rank in 0..12 {
                let members = layout.axis_ranks(rank, axis).unwrap();
                assert_eq!(members.len(), layout.size(axis));
                assert!(members.contains(&rank));
                // The position in the group is the coordinate on the axis.
                let pos = members.iter().position(|&r| r == rank).unwrap();
                assert_eq!(pos, layout.coordinate(rank, axis).unwrap());
                // Members differ from `rank` only in the `axis` coordinate.
                let mine = layout.coords(rank).unwrap();
                for &m in &members {
                    let theirs = layout.coords(m).unwrap();
                    for (i, (&(a, _), (x, y))) in layout
                        .dims()
                        .iter()
                        .zip(mine.iter().zip(&theirs))
                        .enumerate()
                    {
                        if a != axis {
                            assert_eq!(x, y, "axis {axis} member {m} differs on dim {i}");
                        }
                    }
                    seen[m] += 1;
                }
            }
            // Every rank appears in exactly size(axis) groups' member lists (its own
            // group listed once per member).
            assert!(seen.iter().all(|&c| c == layout.size(axis)));
        }
    }

    #[test]
    fn last_axis_is_fastest() {
        let layout = MeshLayout::new(&[(Dp, 2), (Tp, 2)]).unwrap();
        assert_eq!(layout.axis_ranks(0, Tp).unwrap(), vec![0, 1]);
        assert_eq!(layout.axis_ranks(0, Dp).unwrap(), vec![0, 2]);
        assert_eq!(layout.axis_ranks(3, Dp).unwrap(), vec![1, 3]);
        assert_eq!(layout.coords(3).unwrap(), vec![1, 1]);
        assert!(layout.coords(4).is_err());
    }

    #[test]
    fn ranks_sharing_spans_the_other_axes() {
        let layout = MeshLayout::new(&[(Dp, 2), (Pp, 2), (Cp, 2), (Tp, 2)]).unwrap();
        // Rank 5 = (dp 0, pp 1, cp 0, tp 1): the dp × cp group keeps pp 1 and tp 1.
        assert_eq!(
            layout.ranks_sharing(5, &[Pp, Tp]).unwrap(),
            vec![5, 7, 13, 15]
        );
        // One free axis is that axis's group.
        for rank in 0..16 {
            assert_eq!(
                layout.ranks_sharing(rank, &[Dp, Pp, Cp]).unwrap(),
                layout.axis_ranks(rank, Tp).unwrap()
            );
        }
        assert!(layout.ranks_sharing(16, &[Dp]).is_err());
    }
}
