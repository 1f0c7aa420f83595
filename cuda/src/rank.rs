//! One process per device, as torchrun, Slurm and mpirun launch jobs
//! ([`crate::CudaBackend::run_rank`]): process `rank` of `world` runs device `rank`'s
//! lanes of a plan, on the backend's GPU 0 (give each process its GPU with
//! `CUDA_VISIBLE_DEVICES`; without it every rank runs on the one GPU, where handles to
//! the same device work across processes).
//!
//! Each rank allocates its part of the symmetric heap (every buffer of its device, then
//! its semaphores) with the CUDA VMM (`cuMemCreate` with a POSIX file-descriptor handle),
//! and the ranks exchange the handles at a rendezvous that needs no service: rank 0
//! listens on a Unix-domain socket, the others connect, and the descriptors travel as
//! `SCM_RIGHTS`. Each rank maps its peers' parts, so a peer's buffer or semaphore is an
//! address like its own, and the op encoding is the one-process path's. Meetings:
//! 1. **hello**: the plan's digest (every rank must run the same plan), the rank, the
//!    heap's size and its descriptor; rank 0 answers with everyone's;
//! 2. **ready**: after every rank generated its inputs, poisoned its scratch, zeroed
//!    its semaphores and made its lanes ready to enqueue (streams, cuBLAS handles and
//!    their kernels loaded), so that no peer writes into memory not yet initialised and
//!    no rank's setup counts against its peers' wait deadline;
//! 3. **done**: after every rank's lanes finished, so that no rank reads its results back
//!    while a peer may still write into them.
//!
//! A rank that does not come, leaves or dies makes the others fail with a typed error:
//! at a meeting within the rendezvous timeout ([`CudaError::Rendezvous`]), during the run
//! within the wait deadline (its peers' waits time out, [`CudaError::WaitTimeout`]).
//! Every rank unmaps and releases what it mapped, whatever happened (peers keep their own
//! mappings of its memory alive until they release them).
//!
//! The hardware-queue proof holds per process: each rank enqueues its ops in the plan's
//! schedule order, which cannot hang under any mapping of streams to queues, its own
//! queues included.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cmm_core::plan::Plan;
use cudarc::driver::{sys, CudaContext};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

use crate::error::CudaError;

/// The most ranks one rendezvous takes (descriptors per `SCM_RIGHTS` message stay well
/// under the kernel's 253).
pub const MAX_RANKS: usize = 64;

/// The variable naming the rendezvous socket's path ([`Rendezvous::from_env`]).
pub const RENDEZVOUS_VAR: &str = "CMM_RENDEZVOUS";

/// Where process `rank` of `world` meets its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendezvous {
    /// This process's rank: the plan's device it runs.
    pub rank: usize,
    /// How many processes: the plan's device count.
    pub world: usize,
    /// The Unix-domain socket rank 0 listens on (one node: every rank sees the path).
    pub socket: PathBuf,
    /// How long a rank waits for its peers at each meeting.
    pub timeout: Duration,
}

impl Rendezvous {
    /// The rendezvous torchrun's environment describes: `RANK` and `WORLD_SIZE`, and the
    /// socket at `CMM_RENDEZVOUS` or, without it, `$TMPDIR/cmm-rendezvous-$MASTER_PORT`
    /// (torchrun sets `MASTER_PORT` per job). 60 s per meeting.
    pub fn from_env() -> Result<Rendezvous, CudaError> {
        let number = |variable: &'static str| -> Result<usize, CudaError> {
            let value = std::env::var(variable).unwrap_or_default();
            value.trim().parse().map_err(|_| CudaError::Environment {
                variable,
                value,
                expected: "a non-negative integer (as torchrun sets it)",
            })
        };
        let (rank, world) = (number("RANK")?, number("WORLD_SIZE")?);
        let socket = match std::env::var_os(RENDEZVOUS_VAR) {
            Some(path) => PathBuf::from(path),
            None => std::env::temp_dir().join(format!("cmm-rendezvous-{}", number("MASTER_PORT")?)),
        };
        Ok(Rendezvous { rank, world, socket, timeout: Duration::from_secs(60) })
    }

    fn error(&self, what: impl Into<String>) -> CudaError {
        CudaError::Rendezvous { rank: self.rank, world: self.world, socket: self.socket.clone(), what: what.into() }
    }
}

/// A stable digest of the plan (FNV-1a of its plan file), which every rank must share.
pub(crate) fn plan_digest(plan: &Plan) -> u64 {
    plan.to_file_json().bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

const HELLO_MAGIC: u32 = 0x434d_4d31; // "CMM1"
const HELLO_BYTES: usize = 32;

/// The connections of a meeting: rank 0 holds one per peer (index rank − 1), the others
/// one to rank 0.
#[derive(Debug)]
pub(crate) struct Meeting {
    rendezvous: Rendezvous,
    streams: Vec<UnixStream>,
    deadline_each: Duration,
}

/// A peer's part of the symmetric heap: its size and its handle's descriptor.
pub(crate) type Part = (u64, OwnedFd);

impl Meeting {
    /// Meets every rank: sends this rank's part, returns everyone's in rank order.
    pub(crate) fn hello(rendezvous: &Rendezvous, digest: u64, own: Part) -> Result<(Meeting, Vec<Part>), CudaError> {
        let rv = rendezvous;
        if rv.world == 0 || rv.world > MAX_RANKS || rv.rank >= rv.world {
            return Err(rv.error(format!("rank {} of {} (1 to {MAX_RANKS} ranks)", rv.rank, rv.world)));
        }
        let deadline = Instant::now() + rv.timeout;
        if rv.rank == 0 {
            Meeting::host(rv, digest, own, deadline)
        } else {
            Meeting::join(rv, digest, own, deadline)
        }
    }

    fn host(rv: &Rendezvous, digest: u64, own: Part, deadline: Instant) -> Result<(Meeting, Vec<Part>), CudaError> {
        // A socket left by an earlier job on this path would refuse the bind; anything
        // else there is the user's, and stays.
        if let Ok(meta) = std::fs::symlink_metadata(&rv.socket) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(rv.error("the rendezvous path exists and is not a socket: choose another (CMM_RENDEZVOUS)"));
            }
            std::fs::remove_file(&rv.socket).map_err(|e| rv.error(format!("removing a stale socket: {e}")))?;
        }
        let listener = UnixListener::bind(&rv.socket).map_err(|e| rv.error(format!("listening: {e}")))?;
        let _unlink = Unlink(&rv.socket);
        // Only this user's processes may join (they receive this rank's memory).
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&rv.socket, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| rv.error(format!("restricting the socket to this user: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| rv.error(format!("listening: {e}")))?;
        let mut arrived: Vec<Option<(UnixStream, Part)>> = (0..rv.world).map(|_| None).collect();
        let mut pending = rv.world - 1;
        while pending > 0 {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(|e| rv.error(format!("accepting: {e}")))?;
                    set_deadline(&stream, deadline).map_err(|e| rv.error(e))?;
                    let (rank, world, their_digest, part) = receive_hello(&stream).map_err(|e| rv.error(e))?;
                    if world != rv.world || their_digest != digest {
                        return Err(rv.error(format!(
                            "rank {rank} runs another job: {world} ranks, plan digest {their_digest:016x} (here: {} ranks, {digest:016x})",
                            rv.world
                        )));
                    }
                    if rank == 0 || rank >= rv.world || arrived[rank].is_some() {
                        return Err(rv.error(format!("a second rank {rank} arrived")));
                    }
                    arrived[rank] = Some((stream, part));
                    pending -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> =
                            (1..rv.world).filter(|r| arrived[*r].is_none()).map(|r| r.to_string()).collect();
                        return Err(rv.error(format!(
                            "ranks {} did not come within {:?}",
                            missing.join(", "),
                            rv.timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(rv.error(format!("accepting: {e}"))),
            }
        }
        let mut streams = Vec::with_capacity(rv.world - 1);
        let mut parts = vec![own];
        for slot in arrived.into_iter().skip(1) {
            let (stream, part) = slot.expect("every rank arrived");
            streams.push(stream);
            parts.push(part);
        }
        let sizes: Vec<u8> = parts.iter().flat_map(|(bytes, _)| bytes.to_le_bytes()).collect();
        let fds: Vec<RawFd> = parts.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
        for (i, stream) in streams.iter().enumerate() {
            send_with_fds(stream, &sizes, &fds).map_err(|e| rv.error(format!("answering rank {}: {e}", i + 1)))?;
        }
        Ok((Meeting { rendezvous: rv.clone(), streams, deadline_each: rv.timeout }, parts))
    }

    fn join(rv: &Rendezvous, digest: u64, own: Part, deadline: Instant) -> Result<(Meeting, Vec<Part>), CudaError> {
        let stream = loop {
            match UnixStream::connect(&rv.socket) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(rv.error(format!("rank 0 did not listen within {:?} ({e})", rv.timeout)))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        set_deadline(&stream, deadline).map_err(|e| rv.error(e))?;
        let mut hello = Vec::with_capacity(HELLO_BYTES);
        for word in [HELLO_MAGIC, rv.rank as u32, rv.world as u32, 0] {
            hello.extend_from_slice(&word.to_le_bytes());
        }
        hello.extend_from_slice(&digest.to_le_bytes());
        hello.extend_from_slice(&own.0.to_le_bytes());
        send_with_fds(&stream, &hello, &[own.1.as_raw_fd()]).map_err(|e| rv.error(format!("saying hello: {e}")))?;
        let (sizes, fds) = receive_with_fds(&stream, 8 * rv.world, rv.world)
            .map_err(|e| rv.error(format!("waiting for rank 0's answer: {e}")))?;
        let parts = fds
            .into_iter()
            .enumerate()
            .map(|(r, fd)| (u64::from_le_bytes(sizes[8 * r..8 * r + 8].try_into().expect("8 bytes")), fd))
            .collect();
        Ok((Meeting { rendezvous: rv.clone(), streams: vec![stream], deadline_each: rv.timeout }, parts))
    }

    /// Waits until every rank has reached meeting `phase` (`code` tells meetings apart).
    pub(crate) fn barrier(&self, code: u8, phase: &str) -> Result<(), CudaError> {
        let rv = &self.rendezvous;
        let deadline = Instant::now() + self.deadline_each;
        let byte = [code];
        let failed = |who: String, e: std::io::Error| {
            let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "left (its process ended or gave up)".to_string()
            } else if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
                format!("did not arrive within {:?}", self.deadline_each)
            } else {
                e.to_string()
            };
            rv.error(format!("meeting `{phase}`: {who} {why}"))
        };
        let exchange = |stream: &UnixStream, send_first: bool| -> std::io::Result<()> {
            set_deadline(stream, deadline).map_err(std::io::Error::other)?;
            let mut got = [0u8];
            let mut stream = stream;
            if send_first {
                stream.write_all(&byte)?;
                stream.read_exact(&mut got)?;
            } else {
                stream.read_exact(&mut got)?;
            }
            if got != byte {
                return Err(std::io::Error::other(format!("is at another meeting ({} ≠ {})", got[0], byte[0])));
            }
            Ok(())
        };
        if rv.rank == 0 {
            for (i, stream) in self.streams.iter().enumerate() {
                exchange(stream, false).map_err(|e| failed(format!("rank {}", i + 1), e))?;
            }
            for (i, mut stream) in self.streams.iter().enumerate() {
                stream.write_all(&byte).map_err(|e| failed(format!("rank {}", i + 1), e))?;
            }
            Ok(())
        } else {
            exchange(&self.streams[0], true).map_err(|e| failed("rank 0".into(), e))
        }
    }
}

/// Removes the socket file when rank 0 is done listening.
struct Unlink<'a>(&'a Path);

impl Drop for Unlink<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

fn set_deadline(stream: &UnixStream, deadline: Instant) -> Result<(), String> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(left)).map_err(|e| e.to_string())
}

fn receive_hello(stream: &UnixStream) -> Result<(usize, usize, u64, Part), String> {
    let (bytes, mut fds) = receive_with_fds(stream, HELLO_BYTES, 1).map_err(|e| format!("a hello: {e}"))?;
    let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let wide = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    if word(0) != HELLO_MAGIC {
        return Err("something that is not a cmm rank connected".into());
    }
    let fd = fds.pop().expect("one descriptor");
    Ok((word(1) as usize, word(2) as usize, wide(16), (wide(24), fd)))
}

fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let iov = [IoSlice::new(bytes)];
    let control = [ControlMessage::ScmRights(fds)];
    let sent = sendmsg::<()>(stream.as_raw_fd(), &iov, &control, MsgFlags::empty(), None)?;
    // The descriptors went with the first byte; the rest, if the kernel split the message.
    let mut stream = stream;
    stream.write_all(&bytes[sent..])
}

/// Receives exactly `len` bytes, the first segment carrying exactly `count` descriptors.
fn receive_with_fds(stream: &UnixStream, len: usize, count: usize) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut bytes = vec![0u8; len];
    let mut space = nix::cmsg_space!([RawFd; MAX_RANKS]);
    let (received, fds) = {
        let mut iov = [IoSliceMut::new(&mut bytes)];
        let message = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
        let mut fds = Vec::new();
        for cmsg in message.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                // SAFETY: the kernel just installed these descriptors in this process for
                // this message; nothing else owns them.
                #[allow(unsafe_code)]
                fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        (message.bytes, fds)
    };
    if received == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    if fds.len() != count {
        return Err(std::io::Error::other(format!("{} descriptors came, {count} expected", fds.len())));
    }
    let mut stream = stream;
    stream.read_exact(&mut bytes[received..])?;
    Ok((bytes, fds))
}

/// This rank's part of the symmetric heap and its mappings of every part, unmapped and
/// released on drop.
#[derive(Debug)]
pub(crate) struct SymmetricHeap {
    ctx: Arc<CudaContext>,
    /// Per rank: where its part is mapped here, its size, and this process's handle.
    parts: Vec<Option<(u64, usize, sys::CUmemGenericAllocationHandle)>>,
    own: sys::CUmemGenericAllocationHandle,
}

fn driver(during: &str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(|e| CudaError::driver(during, e))
}

fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: the struct is plain old data for which all zeroes is a valid value.
    #[allow(unsafe_code)]
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    prop
}

impl SymmetricHeap {
    /// Allocates this rank's part (at least `bytes`, rounded up to the VMM granularity) on
    /// `ctx`'s GPU and exports its handle.
    pub(crate) fn create(ctx: &Arc<CudaContext>, bytes: usize) -> Result<(SymmetricHeap, Part), CudaError> {
        ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        let prop = allocation_prop(ctx.ordinal() as i32);
        let mut granularity = 0usize;
        // SAFETY: live out-parameter and property struct.
        #[allow(unsafe_code)]
        driver("asking the VMM granularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let size = bytes.max(1).div_ceil(granularity.max(1)) * granularity.max(1);
        let mut own: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: live out-parameter; the context is current.
        #[allow(unsafe_code)]
        driver("creating the symmetric heap (cuMemCreate)", unsafe { sys::cuMemCreate(&mut own, size, &prop, 0) })?;
        let mut heap = SymmetricHeap { ctx: ctx.clone(), parts: Vec::new(), own };
        let mut fd: i32 = -1;
        // SAFETY: `fd` is a live out-parameter of the type a POSIX descriptor handle takes.
        #[allow(unsafe_code)]
        driver("exporting the symmetric heap's handle", unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut std::ffi::c_void,
                own,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver just created this descriptor for this process.
        #[allow(unsafe_code)]
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        heap.parts.push(None); // filled by `map_all`
        Ok((heap, (size as u64, fd)))
    }

    /// Maps every rank's part (this rank's `rank` through its own handle), in rank order;
    /// returns where each lies.
    pub(crate) fn map_all(&mut self, rank: usize, parts: &[Part]) -> Result<Vec<u64>, CudaError> {
        self.ctx.bind_to_thread().map_err(|e| CudaError::driver("binding a context", e))?;
        self.parts = (0..parts.len()).map(|_| None).collect();
        let mut bases = Vec::with_capacity(parts.len());
        for (r, (size, fd)) in parts.iter().enumerate() {
            let size = *size as usize;
            let handle = if r == rank {
                self.own
            } else {
                let mut handle: sys::CUmemGenericAllocationHandle = 0;
                // SAFETY: live out-parameter; the descriptor is open for the call (the
                // driver keeps its own reference to the memory).
                #[allow(unsafe_code)]
                driver(&format!("importing rank {r}'s heap"), unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut handle,
                        fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })?;
                handle
            };
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: live out-parameter; reserves address space only.
            #[allow(unsafe_code)]
            driver("reserving address space", unsafe { sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0) })?;
            // Recorded before mapping, so that drop undoes whatever was done.
            self.parts[r] = Some((ptr, size, if r == rank { 0 } else { handle }));
            // SAFETY: `ptr` is a fresh reservation of `size` bytes and `handle` a live
            // allocation of that size.
            #[allow(unsafe_code)]
            driver(&format!("mapping rank {r}'s heap"), unsafe { sys::cuMemMap(ptr, size, 0, handle, 0) })?;
            let access = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: self.ctx.ordinal() as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: `ptr` maps `size` bytes; `access` is live for the call.
            #[allow(unsafe_code)]
            driver(&format!("opening rank {r}'s heap to this GPU"), unsafe {
                sys::cuMemSetAccess(ptr, size, &access, 1)
            })?;
            bases.push(ptr);
        }
        Ok(bases)
    }
}

impl Drop for SymmetricHeap {
    fn drop(&mut self) {
        // Errors cannot be reported from a destructor; the context records them.
        self.ctx.record_err(self.ctx.bind_to_thread());
        for (ptr, size, handle) in self.parts.iter().flatten() {
            // SAFETY: each entry was reserved (and possibly mapped) by `map_all`; the run's
            // streams finished before the heap is dropped. Unmapping what was not mapped
            // fails harmlessly.
            #[allow(unsafe_code)]
            unsafe {
                let _ = sys::cuMemUnmap(*ptr, *size);
                let _ = sys::cuMemAddressFree(*ptr, *size);
                if *handle != 0 {
                    let _ = sys::cuMemRelease(*handle);
                }
            }
        }
        // SAFETY: this process's handle of its own part, released once.
        #[allow(unsafe_code)]
        unsafe {
            let _ = sys::cuMemRelease(self.own);
        }
    }
}
