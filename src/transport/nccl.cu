// NCCL symmetric-window transport (transport.h). NCCL's host API is reached through
// dlopen, so nothing links against libnccl: a machine without NCCL runs everything
// else. The device side only reads the window's LSA table (an inline function of
// nccl_device.h), once, to hand the kernels plain peer pointers.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../kernels/cuda_check.h"
#include "megamoe/transport/transport.h"

static_assert(NCCL_VERSION_CODE >= 22800, "the NCCL transport needs the 2.28 device API (symmetric windows)");

namespace megamoe::transport {
namespace {

// The NCCL entry points we use, resolved from the shared library at run time.
struct NcclApi {
  void* lib = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*MemAlloc)(void**, size_t) = nullptr;
  ncclResult_t (*MemFree)(void*) = nullptr;
  ncclResult_t (*CommWindowRegister)(ncclComm_t, void*, size_t, ncclWindow_t*, int) = nullptr;
  ncclResult_t (*CommWindowDeregister)(ncclComm_t, ncclWindow_t) = nullptr;
  ncclResult_t (*GetVersion)(int*) = nullptr;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;

  static const NcclApi& get(const std::string& path) {
    static std::mutex m;
    static NcclApi api;
    std::lock_guard<std::mutex> lock(m);
    if (api.lib) return api;
    std::string name = path;
    if (name.empty())
      name = std::getenv("MEGAMOE_NCCL_LIB") ? std::getenv("MEGAMOE_NCCL_LIB") : "libnccl.so.2";
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h)
      throw std::runtime_error("NCCL transport: cannot load " + name + " (" + dlerror() +
                               "); put NCCL >= 2.28's lib/ on LD_LIBRARY_PATH or set MEGAMOE_NCCL_LIB");
    auto sym = [&](auto& fn, const char* s) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, s));
      if (!fn)
        throw std::runtime_error(std::string("NCCL transport: ") + name + " has no " + s + " (NCCL < 2.28?)");
    };
    NcclApi a;
    sym(a.GetUniqueId, "ncclGetUniqueId");
    sym(a.CommInitRank, "ncclCommInitRank");
    sym(a.CommDestroy, "ncclCommDestroy");
    sym(a.MemAlloc, "ncclMemAlloc");
    sym(a.MemFree, "ncclMemFree");
    sym(a.CommWindowRegister, "ncclCommWindowRegister");
    sym(a.CommWindowDeregister, "ncclCommWindowDeregister");
    sym(a.GetVersion, "ncclGetVersion");
    sym(a.GetErrorString, "ncclGetErrorString");
    int v = 0;
    a.GetVersion(&v);
    Dl_info where{};
    const std::string file =
        dladdr(reinterpret_cast<void*>(a.GetVersion), &where) && where.dli_fname ? where.dli_fname : name;
    // NOTE: the device API (nccl_device.h) is compiled into our kernels and reads the
    // library's window structures, so the library must be the headers' exact release: on
    // the H200 machine the system's 2.28.3 (first on the default library path) passed a
    // >= 2.28 check and the peer lookup against our 2.28.9 headers died with an illegal
    // address (v11); the torch venv's 2.28.9 works.
    if (v != NCCL_VERSION_CODE) {
      dlclose(h);
      throw std::runtime_error("NCCL transport: " + file + " is version " + std::to_string(v) +
                               ", built against " + std::to_string(NCCL_VERSION_CODE) +
                               " (the device API needs that exact release); put its lib/ on LD_LIBRARY_PATH "
                               "or set MEGAMOE_NCCL_LIB");
    }
    a.lib = h;
    api = a;
    return api;
  }
  void check(ncclResult_t r, const char* call, int rank) const {
    if (r != ncclSuccess)
      throw std::runtime_error(std::string("NCCL transport: ") + call + " failed on rank " +
                               std::to_string(rank) + ": " + GetErrorString(r));
  }
};

// Every peer's base of the window as this rank's kernels address it, and the window's
// own rank numbers: ncclGetPeerPointer is arithmetic on the window's flat base of its
// load/store-accessible (LSA) team, valid for every peer only where that team is the
// whole world in world order (lsa rank == world rank on every rank).
__global__ void resolve_peers(ncclWindow_t w, int world, uint8_t** out, int* ranks) {
  const int p = threadIdx.x;
  if (p < world) out[p] = static_cast<uint8_t*>(ncclGetPeerPointer(w, 0, p));
  if (p == 0) ranks[0] = w->lsaRank, ranks[1] = w->worldRank;
}

// The local ranks' threads meet here between the steps: a step that failed on one rank
// (a device, an allocation) stops all before the next collective call, which would
// otherwise wait for it forever. (Ranks in other processes cannot be told: they wait
// for this one until their own timeouts.)
class LocalGate {
 public:
  explicit LocalGate(int n) : n_(n) {}
  bool pass(bool ok) {  // false: a local rank failed (now or before)
    std::unique_lock<std::mutex> l(m_);
    failed_ |= !ok;
    const int gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0, ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return gen_ != gen; });
    }
    return !failed_;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, arrived_ = 0, gen_ = 0;
  bool failed_ = false;
};

ncclUniqueId rendezvous_id(const NcclApi& api, const NcclOptions& o, bool creator) {
  ncclUniqueId id{};
  if (creator) {
    // Rank 0 removes the file once every rank has joined (NcclTransport), so one found here
    // is an earlier run's that died first: the other ranks may have read its stale id.
    if (std::ifstream(o.rendezvous).good())
      std::fprintf(stderr,
                   "megamoe: NCCL transport: replacing %s, left by an earlier run; ranks that read it "
                   "first hold a stale id and will fail to join (use a fresh path per run)\n",
                   o.rendezvous.c_str());
    api.check(api.GetUniqueId(&id), "ncclGetUniqueId", 0);
    const std::string tmp = o.rendezvous + ".tmp." + std::to_string(getpid());
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(id.internal, sizeof id.internal);
      if (!f) throw std::runtime_error("NCCL transport: cannot write the rendezvous file " + tmp);
    }
    if (std::rename(tmp.c_str(), o.rendezvous.c_str()) != 0)  // atomic: readers see all of it or nothing
      throw std::runtime_error("NCCL transport: cannot publish the rendezvous file " + o.rendezvous);
    return id;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(o.rendezvous, std::ios::binary);
    if (f && f.read(id.internal, sizeof id.internal) && f.gcount() == sizeof id.internal) return id;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > o.rendezvous_timeout_s)
      throw std::runtime_error("NCCL transport: rank 0 did not publish " + o.rendezvous + " within " +
                               std::to_string(o.rendezvous_timeout_s) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(const kernels::EpLayout& l, const NcclOptions& opt) : layout_(l) {
    const int R = l.ranks;
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // never NVLink multicast objects
    const NcclApi& api = NcclApi::get(opt.library);
    api_ = &api;
    ranks_ = opt.local_ranks;
    devices_ = opt.devices;
    if (ranks_.empty())
      for (int r = 0; r < R; ++r) ranks_.push_back(r);
    if (devices_.empty()) devices_ = ranks_;
    MEGAMOE_CHECK(devices_.size() == ranks_.size(), "NCCL transport: one device per local rank");
    for (int r : ranks_) MEGAMOE_CHECK(r >= 0 && r < R, "NCCL transport: no rank " + std::to_string(r));
    const bool all_here = int(ranks_.size()) == R;
    MEGAMOE_CHECK(all_here || !opt.rendezvous.empty(),
                  "NCCL transport: a process driving some of the ranks needs a rendezvous file");
    ncclUniqueId id{};
    bool have_zero = false;
    for (int r : ranks_) have_zero |= r == 0;
    if (opt.rendezvous.empty()) {
      api.check(api.GetUniqueId(&id), "ncclGetUniqueId", 0);
    } else {  // (also with every rank here: a dry run of the one-process-per-GPU bootstrap)
      id = rendezvous_id(api, opt, have_zero);
    }
    const size_t bytes = (l.total_bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
                         NCCL_WIN_REQUIRED_ALIGNMENT;
    const int n = int(ranks_.size());
    check_devices();
    comms_.assign(n, nullptr);
    wins_.assign(n, nullptr);
    bufs_.assign(n, nullptr);
    tables_.assign(n, PeerTable{});
    // NOTE: communicator creation and window registration are collective: the local
    // ranks run them concurrently, one thread each.
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    LocalGate gate(n);
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        const int r = ranks_[i];
        auto step = [&](auto&& fn) {
          try {
            fn();
            return true;
          } catch (const std::exception& e) {
            errors[i] = e.what();
            return false;
          }
        };
        bool ok = step([&] {
          MEGAMOE_CUDA_CHECK(cudaSetDevice(devices_[i]));
          api.check(api.CommInitRank(&comms_[i], R, id, r), "ncclCommInitRank", r);
          api.check(api.MemAlloc(reinterpret_cast<void**>(&bufs_[i]), bytes), "ncclMemAlloc", r);
          MEGAMOE_CUDA_CHECK(cudaMemset(bufs_[i], 0, bytes));  // signals start below any epoch
          MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
        });
        if (!gate.pass(ok)) return;
        step([&] {
          api.check(api.CommWindowRegister(comms_[i], bufs_[i], bytes, &wins_[i], NCCL_WIN_COLL_SYMMETRIC),
                    "ncclCommWindowRegister", r);
          MEGAMOE_CHECK(wins_[i] != nullptr, "NCCL transport: ncclCommWindowRegister gave rank " +
                                                 std::to_string(r) + " no window");
          uint8_t** d = nullptr;
          MEGAMOE_CUDA_CHECK(cudaMalloc(&d, sizeof(uint8_t*) * kMaxRanks + 2 * sizeof(int)));
          int* wr = reinterpret_cast<int*>(d + kMaxRanks);
          resolve_peers<<<1, 32>>>(wins_[i], R, d, wr);
          MEGAMOE_CUDA_CHECK(cudaGetLastError());
          PeerTable& t = tables_[i];
          t.ranks = R;
          t.rank = r;
          int wranks[2] = {-1, -1};
          MEGAMOE_CUDA_CHECK(cudaMemcpy(t.base, d, sizeof(uint8_t*) * R, cudaMemcpyDeviceToHost));
          MEGAMOE_CUDA_CHECK(cudaMemcpy(wranks, wr, sizeof wranks, cudaMemcpyDeviceToHost));
          cudaFree(d);
          if (wranks[0] != r || wranks[1] != r)
            throw std::runtime_error(
                "NCCL transport: rank " + std::to_string(r) + " is rank " + std::to_string(wranks[0]) +
                " of its load/store-accessible team (world rank " + std::to_string(wranks[1]) +
                "): the GPUs of the group cannot all reach each other's memory (NVLink or PCIe peer "
                "access), which the kernels' peer pointers need");
          for (int q = 0; q < R; ++q)
            MEGAMOE_CHECK(t.base[q] != nullptr, "NCCL transport: rank " + std::to_string(r) +
                                                    " has no window pointer of rank " + std::to_string(q));
        });
      });
    for (auto& t : threads) t.join();
    // Every rank has joined (or failed to): the id is spent, and a file left behind would
    // hand the next run's ranks a stale one.
    if (have_zero && !opt.rendezvous.empty()) std::remove(opt.rendezvous.c_str());
    for (const std::string& e : errors)
      if (!e.empty()) {
        release();
        throw std::runtime_error(e);
      }
  }
  ~NcclTransport() override { release(); }
  int ranks() const override { return layout_.ranks; }
  const kernels::EpLayout& layout() const override { return layout_; }
  std::vector<int> local_ranks() const override { return ranks_; }
  int device(int rank) const override { return devices_[index(rank)]; }
  PeerTable peers(int rank) const override { return tables_[index(rank)]; }

 private:
  int index(int rank) const {
    for (size_t i = 0; i < ranks_.size(); ++i)
      if (ranks_[i] == rank) return int(i);
    throw std::runtime_error("NCCL transport: rank " + std::to_string(rank) +
                             " is not driven by this process");
  }
  // Before any collective call (a thread that fails to reach one leaves the others waiting
  // in it): every local rank on its own visible device, and one process's devices able
  // to reach each other's memory.
  void check_devices() const {
    int count = 0;
    MEGAMOE_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (size_t i = 0; i < devices_.size(); ++i) {
      const int d = devices_[i];
      if (d < 0 || d >= count)
        throw std::invalid_argument("NCCL transport: rank " + std::to_string(ranks_[i]) + " on device " +
                                    std::to_string(d) + ", but this process sees " + std::to_string(count) +
                                    " GPU(s) (one GPU a rank: at most as many ranks as GPUs)");
      for (size_t j = 0; j < i; ++j) {
        if (devices_[j] == d)
          throw std::invalid_argument("NCCL transport: ranks " + std::to_string(ranks_[j]) + " and " +
                                      std::to_string(ranks_[i]) + " on the same device " + std::to_string(d));
        int can = 0;
        MEGAMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, d, devices_[j]));
        if (!can)
          throw std::invalid_argument("NCCL transport: device " + std::to_string(d) +
                                      " cannot access device " + std::to_string(devices_[j]) +
                                      "'s memory (no peer access)");
      }
    }
  }
  void release() {
    // NOTE: deregistration is collective too: one thread per local rank.
    std::vector<std::thread> threads;
    for (size_t i = 0; i < comms_.size(); ++i)
      threads.emplace_back([this, i] {
        cudaSetDevice(devices_[i]);
        if (wins_[i]) api_->CommWindowDeregister(comms_[i], wins_[i]);
        if (bufs_[i]) api_->MemFree(bufs_[i]);
        if (comms_[i]) api_->CommDestroy(comms_[i]);
      });
    for (auto& t : threads) t.join();
    comms_.clear(), wins_.clear(), bufs_.clear();
  }
  kernels::EpLayout layout_;
  const NcclApi* api_ = nullptr;
  std::vector<int> ranks_, devices_;
  std::vector<ncclComm_t> comms_;
  std::vector<ncclWindow_t> wins_;
  std::vector<uint8_t*> bufs_;
  std::vector<PeerTable> tables_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const kernels::EpLayout& layout, const NcclOptions& opt) {
  return std::make_unique<NcclTransport>(layout, opt);
}

}  // namespace megamoe::transport
