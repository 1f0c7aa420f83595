//! `--stats`: the communication volume of each case's plan, measured from the plan
//! ([`cmm_core::mesh::mesh_traffic`]): bytes each device sends, per mesh direction for
//! mesh cases (beside the traffic cost of seed 002 §2.3.1), in total for 1D and linear
//! cases.

use cmm_core::mesh::{mesh_traffic, MeshTraffic};

use crate::case::{Case, CaseProblem};

/// Per-device values: one number when every device sends the same, else the list.
fn per_device(values: &[u64]) -> String {
    match MeshTraffic::uniform(values) {
        Some(v) => format!("{v} B on every device"),
        None => format!("[{}] B", values.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// The traffic line of a case, or `None` when it has no plan (its row already says why).
pub fn traffic_line(case: &Case) -> Option<String> {
    let plan = case.plan().ok()?;
    Some(match case.problem().ok()? {
        CaseProblem::Mesh(p) => {
            let t = mesh_traffic(&plan, p.nr, p.nc).ok()?;
            let (row, col) = p.analytic_traffic();
            let mut line = format!(
                "  traffic sent, within mesh rows: {}; within mesh columns: {}",
                per_device(&t.row),
                per_device(&t.col)
            );
            if t.other.iter().any(|&x| x > 0) {
                line += &format!("; off the mesh links: {}", per_device(&t.other));
            }
            line + &format!("; seed 002 §2.3.1 (Nc−1)·size/(Nr·Nc): rows {row} B, columns {col} B")
        }
        CaseProblem::Ring(_) | CaseProblem::Linear(_) | CaseProblem::Attention(_) | CaseProblem::Moe(_) => {
            let t = mesh_traffic(&plan, 1, plan.devices).ok()?;
            format!("  traffic sent: {}", per_device(&t.row))
        }
    })
}
