//! Shared resources of a simulated system and the route of every copy through them.
//!
//! Resources: per device its compute (capacity 1 work-second per second) and its HBM
//! (bytes/s); per directed link or switch port its bandwidth (bytes/s). A copy to a peer
//! uses the resources of its route; concurrent users of one resource share it fairly.
//! On one GPU (`one_gpu`) every device shares one compute and one HBM, and there are no
//! links; where the profile gives the driver's copy rate, the copies the driver makes its
//! own way share that too.

use super::profile::{Profile, TopologyKind};

/// Index of a resource in [`Topology::resources`].
pub type ResId = usize;

/// What a resource is.
#[derive(Clone, Debug, PartialEq)]
pub enum ResourceKind {
    /// A device's GEMM/reduce engine.
    Compute,
    /// A device's HBM (local copies).
    Hbm,
    /// A directed link or switch port: counts towards the communication floor.
    Link,
    /// On one GPU, the rate the driver's own copies between virtual devices share
    /// (`copy.driver_gbps`, as bytes read and written).
    DriverCopies,
}

/// One shared resource.
#[derive(Clone, Debug, PartialEq)]
pub struct Resource {
    /// Name for reports, e.g. `dev3 egress` or `2->3 (dim 0 +)`.
    pub name: String,
    /// Units per second.
    pub capacity: f64,
    /// Kind.
    pub kind: ResourceKind,
}

/// The resources of `devices` devices wired as a profile says.
#[derive(Clone, Debug)]
pub struct Topology {
    kind: TopologyKind,
    devices: usize,
    /// Torus dimensions (device index is row-major over them); `[devices]` for a ring.
    dims: Vec<usize>,
    /// Every resource.
    pub resources: Vec<Resource>,
    links_base: usize,
    /// Multi-node: devices per node and the index of the first NIC resource (each
    /// device's egress, then each device's ingress).
    nodes: Option<(usize, ResId)>,
    /// One-way latency of a hop inside a node and between nodes, seconds.
    latency_s: (f64, f64),
}

impl Topology {
    /// Builds the topology; `dims` is the torus shape (product = devices), ignored by a switch.
    pub fn new(profile: &Profile, devices: usize, dims: Vec<usize>) -> Topology {
        let mut resources = Vec::new();
        let latency_s =
            (profile.interconnect.link_latency_us * 1e-6, profile.network.map_or(0.0, |n| n.latency_us * 1e-6));
        if profile.interconnect.topology == TopologyKind::OneGpu {
            resources.push(Resource { name: "gpu compute".into(), capacity: 1.0, kind: ResourceKind::Compute });
            resources.push(Resource { name: "gpu hbm".into(), capacity: profile.hbm_bps(), kind: ResourceKind::Hbm });
            if let Some(gbps) = profile.copy.driver_gbps {
                let capacity = 2e9 * gbps;
                resources.push(Resource { name: "driver copies".into(), capacity, kind: ResourceKind::DriverCopies });
            }
            let links_base = resources.len();
            let kind = TopologyKind::OneGpu;
            return Topology { kind, devices, dims, resources, links_base, nodes: None, latency_s };
        }
        for d in 0..devices {
            resources.push(Resource { name: format!("dev{d} compute"), capacity: 1.0, kind: ResourceKind::Compute });
        }
        for d in 0..devices {
            resources.push(Resource {
                name: format!("dev{d} hbm"),
                capacity: profile.hbm_bps(),
                kind: ResourceKind::Hbm,
            });
        }
        let links_base = resources.len();
        let bw = profile.link_bps();
        match profile.interconnect.topology {
            TopologyKind::Switch => {
                for d in 0..devices {
                    resources.push(Resource { name: format!("dev{d} egress"), capacity: bw, kind: ResourceKind::Link });
                }
                for d in 0..devices {
                    resources.push(Resource {
                        name: format!("dev{d} ingress"),
                        capacity: bw,
                        kind: ResourceKind::Link,
                    });
                }
            }
            TopologyKind::OneGpu => unreachable!("one GPU returned above"),
            TopologyKind::Torus => {
                for d in 0..devices {
                    for (dim, _) in dims.iter().enumerate() {
                        for sign in ['+', '-'] {
                            resources.push(Resource {
                                name: format!("dev{d} dim{dim}{sign}"),
                                capacity: bw,
                                kind: ResourceKind::Link,
                            });
                        }
                    }
                }
            }
        }
        let nodes = profile.network.map(|net| {
            let base = resources.len();
            for (dir, d) in ["egress", "ingress"].iter().flat_map(|dir| (0..devices).map(move |d| (dir, d))) {
                resources.push(Resource {
                    name: format!("dev{d} nic {dir}"),
                    capacity: net.nic_gbps * 1e9,
                    kind: ResourceKind::Link,
                });
            }
            (net.devices_per_node, base)
        });
        Topology { kind: profile.interconnect.topology, devices, dims, resources, links_base, nodes, latency_s }
    }

    /// Whether a copy from `src` to `dst` crosses the network between nodes.
    fn between_nodes(&self, src: usize, dst: usize) -> bool {
        self.nodes.is_some_and(|(per, _)| src / per != dst / per)
    }

    /// Whether every device is a virtual device of one GPU.
    pub fn one_gpu(&self) -> bool {
        self.kind == TopologyKind::OneGpu
    }

    /// The compute resource of a device.
    pub fn compute(&self, device: usize) -> ResId {
        if self.one_gpu() {
            0
        } else {
            device
        }
    }

    /// On one GPU, the rate the driver's own copies share, where the profile gives it.
    pub fn driver_copies(&self) -> Option<ResId> {
        self.resources.iter().position(|r| r.kind == ResourceKind::DriverCopies)
    }

    /// The HBM resource of a device.
    pub fn hbm(&self, device: usize) -> ResId {
        if self.one_gpu() {
            1
        } else {
            self.devices + device
        }
    }

    fn coords(&self, mut device: usize) -> Vec<usize> {
        let mut c = vec![0; self.dims.len()];
        for i in (0..self.dims.len()).rev() {
            c[i] = device % self.dims[i];
            device /= self.dims[i];
        }
        c
    }

    fn index(&self, coords: &[usize]) -> usize {
        coords.iter().zip(&self.dims).fold(0, |acc, (c, d)| acc * d + c)
    }

    fn torus_link(&self, device: usize, dim: usize, positive: bool) -> ResId {
        self.links_base + (device * self.dims.len() + dim) * 2 + usize::from(!positive)
    }

    /// The link resources a copy from `src` to `dst` (a peer) crosses, in order (none on
    /// one GPU, where the copy goes through its HBM instead).
    pub fn route(&self, src: usize, dst: usize) -> Vec<ResId> {
        if let (true, Some((_, nic))) = (self.between_nodes(src, dst), self.nodes) {
            return vec![nic + src, nic + self.devices + dst];
        }
        match self.kind {
            TopologyKind::Switch => vec![self.links_base + src, self.links_base + self.devices + dst],
            TopologyKind::OneGpu => Vec::new(),
            TopologyKind::Torus => {
                // Dimension-order routing, the shorter way round (ties go the + way).
                let mut at = self.coords(src);
                let to = self.coords(dst);
                let mut links = Vec::new();
                for dim in 0..self.dims.len() {
                    let n = self.dims[dim];
                    let forward = (to[dim] + n - at[dim]) % n;
                    let positive = forward <= n - forward;
                    let hops = if positive { forward } else { n - forward };
                    for _ in 0..hops {
                        let here = self.index(&at);
                        links.push(self.torus_link(here, dim, positive));
                        at[dim] = if positive { (at[dim] + 1) % n } else { (at[dim] + n - 1) % n };
                    }
                }
                links
            }
        }
    }

    /// Number of hops a copy from `src` to `dst` takes (latency is paid per hop).
    pub fn hops(&self, src: usize, dst: usize) -> usize {
        match self.kind {
            TopologyKind::Switch | TopologyKind::OneGpu => usize::from(src != dst),
            TopologyKind::Torus => self.route(src, dst).len(),
        }
    }

    /// One-way latency of a small write from `src` to `dst`: per hop inside a node, the
    /// network's between nodes.
    pub fn latency_s(&self, src: usize, dst: usize) -> f64 {
        if self.between_nodes(src, dst) {
            self.latency_s.1
        } else {
            self.hops(src, dst) as f64 * self.latency_s.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torus_routes_take_the_short_way_dimension_by_dimension() {
        let p = Profile::load("tpuv4-torus").unwrap();
        let t = Topology::new(&p, 16, vec![4, 4]);
        assert_eq!(t.route(0, 1).len(), 1);
        assert_eq!(t.route(0, 3).len(), 1, "wraps round");
        assert_eq!(t.route(0, 5).len(), 2);
        assert_eq!(t.route(0, 10).len(), 4);
        assert_eq!(t.route(0, 3), vec![t.torus_link(0, 1, false)]);
        let ring = Topology::new(&p, 8, vec![8]);
        assert_eq!(ring.hops(0, 7), 1);
        assert_eq!(ring.hops(0, 4), 4);
    }

    #[test]
    fn nodes_talk_through_their_nics_and_pay_the_network_latency() {
        let p = Profile::load("h100-ib").unwrap();
        let t = Topology::new(&p, 16, vec![16]);
        let inside = t.route(1, 2);
        assert_eq!(
            (t.resources[inside[0]].name.as_str(), t.resources[inside[1]].name.as_str()),
            ("dev1 egress", "dev2 ingress")
        );
        let across = t.route(7, 8);
        assert_eq!(t.resources[across[0]].name, "dev7 nic egress");
        assert_eq!(t.resources[across[1]].name, "dev8 nic ingress");
        assert!(t.resources[across[0]].capacity < t.resources[inside[0]].capacity);
        assert!(t.latency_s(7, 8) > t.latency_s(1, 2));
        assert_eq!(t.latency_s(3, 3), 0.0);
    }

    #[test]
    fn switch_routes_use_egress_and_ingress() {
        let p = Profile::load("h100-nvlink").unwrap();
        let t = Topology::new(&p, 4, vec![4]);
        let r = t.route(1, 2);
        assert_eq!(r.len(), 2);
        assert_eq!(t.resources[r[0]].name, "dev1 egress");
        assert_eq!(t.resources[r[1]].name, "dev2 ingress");
    }
}
