// Transports of expert parallelism: they allocate every rank's symmetric
// buffer (kernels::EpLayout) and hand each rank's kernel the table of peer base
// addresses, through which it reads and writes the other ranks' regions with plain
// loads and stores. Nothing here knows the MoE math.
//   - virtual ranks: R ranks in one process on one GPU (each its own buffer); the
//     whole protocol runs and is tested where there is a single GPU;
//   - NCCL symmetric windows (NCCL >= 2.28, LSA pointers): R GPUs in one NVLink
//     domain, one process driving several (or all) of them or one process per GPU
//     (the unique id passes through a rendezvous file). NCCL is loaded at run time
//     (dlopen), only when this transport is asked for (find_nccl): the library and
//     the tools start without it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/kernels/ep_layout.h"

namespace megamoe::transport {

constexpr int kMaxRanks = 1 << kernels::EpLayout::kRankBits;

// Passed by value to a rank's kernel: base[q] is rank q's symmetric buffer as this
// rank addresses it (its own at base[rank]).
struct PeerTable {
  int ranks = 0;
  int rank = 0;
  uint8_t* base[kMaxRanks] = {};
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int ranks() const = 0;
  virtual const kernels::EpLayout& layout() const = 0;
  // The ranks this process drives, and the CUDA device of each.
  virtual std::vector<int> local_ranks() const = 0;
  virtual int device(int rank) const = 0;
  // The table of `rank` (a rank this process drives).
  virtual PeerTable peers(int rank) const = 0;
};

// R = layout.ranks virtual ranks on the current CUDA device: one zeroed device
// allocation of layout.total_bytes per rank. Throws with the CUDA error if memory
// runs out (the message names the rank and the bytes).
std::unique_ptr<Transport> make_virtual_ranks(const kernels::EpLayout& layout);

// Where the NCCL search looks besides its fixed places: the library's switches
// (kernels::Overrides: MEGAMOE_NCCL_LIB, VIRTUAL_ENV, CONDA_PREFIX), passed down from the API
// edge; the transport reads no environment.
struct NcclSearch {
  std::string library;                       // MEGAMOE_NCCL_LIB: this library alone (an explicit choice)
  std::vector<std::string> python_prefixes;  // VIRTUAL_ENV, CONDA_PREFIX: Python environments to search
};

struct NcclOptions {
  // The ranks this process drives and their CUDA devices; empty: every rank of the
  // layout, rank r on device r (one process for all GPUs).
  std::vector<int> local_ranks;
  std::vector<int> devices;
  // One process per GPU (local_ranks smaller than the world): rank 0 writes NCCL's
  // unique id here, the others wait for it (up to rendezvous_timeout_s).
  std::string rendezvous;
  double rendezvous_timeout_s = 60;
  // The NCCL library to load; empty: the one find_nccl(search) chooses. A library named here
  // (like MEGAMOE_NCCL_LIB) is an explicit choice: if it cannot serve, that is an error.
  std::string library;
  NcclSearch search;
};

// ---- Which NCCL the transport loads (dlopen'ed: nothing links against libnccl) ----

// One library the search looked at.
struct NcclCandidate {
  std::string origin;   // where the search found it: MEGAMOE_NCCL_LIB, beside the build's NCCL headers,
                        // Python package nvidia-nccl, system loader
  std::string path;     // the file (the system loader's: the file it resolved libnccl.so.2 to)
  int version = 0;      // its ncclGetVersion code (22809 = 2.28.9); 0 where not reached
  std::string refused;  // why it cannot serve this build; empty: usable
};

struct NcclLibrary {
  std::string path;  // the library the transport uses; empty: none is usable
  int version = 0;
  bool explicit_choice = false;      // MEGAMOE_NCCL_LIB (or NcclOptions::library) named it
  std::vector<NcclCandidate> tried;  // in search order; the chosen one last
  bool usable() const { return !path.empty(); }
  // One line: no usable NCCL, each candidate with why it was refused, and how to name one.
  std::string why_none() const;
};

// The search, once a process (later calls return the first answer): where.library
// (MEGAMOE_NCCL_LIB) alone if set; else the library beside the NCCL headers of the build, the
// Python packages' copy (nvidia-nccl, as PyTorch installs it: where.python_prefixes, /opt/*,
// ~/.local, /usr/local), then the system's libnccl.so.2. The first that can serve the
// device side compiled here is kept loaded (nccl.cu says which releases can, and why).
// Needs no GPU.
const NcclLibrary& find_nccl(const NcclSearch& where);
// find_nccl with the library's switches (the API edge's, src/api/cuda_backend.cu).
const NcclLibrary& find_nccl();
// NCCL_VERSION_CODE of the headers this build compiled against, and a code as "2.28.9".
int nccl_headers_version();
std::string nccl_version_string(int code);
// The releases the NCCL transport accepts, as "2.28.x >= 2.28.9" (nccl.cu says why).
std::string nccl_requirement();

// Symmetric buffers in NCCL windows (ncclMemAlloc + ncclCommWindowRegister, symmetric
// registration); peer bases are the windows' LSA pointers, read once at setup. Sets
// NCCL_NVLS_ENABLE=0 (no NVLink multicast objects) unless the caller set it. Errors
// name the NCCL call, the rank and NCCL's message; with no usable NCCL, the error is
// NcclLibrary::why_none().
std::unique_ptr<Transport> make_nccl_transport(const kernels::EpLayout& layout, const NcclOptions& opt);

}  // namespace megamoe::transport
