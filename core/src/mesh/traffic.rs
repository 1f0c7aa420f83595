//! Communication volume of a plan on a mesh, measured from the plan itself: the bytes of
//! every `Copy` to another device, charged to the sending device and split by direction.

use super::MeshError;
use crate::plan::{Op, Plan};

/// Bytes each device sends, by direction (seed 002 §2.3.1 calls the row direction
/// horizontal, between columns, and the column direction vertical, between rows).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshTraffic {
    /// Per device, bytes sent to chips of its mesh row.
    pub row: Vec<u64>,
    /// Per device, bytes sent to chips of its mesh column.
    pub col: Vec<u64>,
    /// Per device, bytes sent to chips sharing neither (no mesh algorithm does this; a
    /// non-zero value shows a plan that skips the mesh links).
    pub other: Vec<u64>,
}

impl MeshTraffic {
    /// The common value of `values` when every device sends the same, else `None`.
    pub fn uniform(values: &[u64]) -> Option<u64> {
        let first = *values.first()?;
        values.iter().all(|&v| v == first).then_some(first)
    }
}

/// Measures `plan` on an `nr`×`nc` mesh (device `i·nc + j` is chip (i, j)). Copies within
/// a device move no bytes between chips and are not counted.
pub fn mesh_traffic(plan: &Plan, nr: usize, nc: usize) -> Result<MeshTraffic, MeshError> {
    if nr == 0 || nc == 0 {
        return Err(MeshError::EmptyMesh { nr, nc });
    }
    if plan.devices as u128 != nr as u128 * nc as u128 {
        return Err(MeshError::DeviceCount { plan: plan.name.clone(), devices: plan.devices, nr, nc });
    }
    let mut traffic =
        MeshTraffic { row: vec![0; plan.devices], col: vec![0; plan.devices], other: vec![0; plan.devices] };
    for (site, op) in plan.ops() {
        let Op::Copy { src, dst_device, .. } = op else { continue };
        let (from, to) = (site.device, *dst_device);
        if from == to {
            continue;
        }
        let bytes = (src.len() * plan.buffer(src.buf).dtype.size_bytes()) as u64;
        let bucket = if from / nc == to / nc {
            &mut traffic.row
        } else if from % nc == to % nc {
            &mut traffic.col
        } else {
            &mut traffic.other
        };
        bucket[from] += bytes;
    }
    Ok(traffic)
}
