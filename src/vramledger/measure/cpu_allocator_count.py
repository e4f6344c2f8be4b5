"""An independent count of the bytes PyTorch's CPU allocator hands out, on every thread.

A small C++ wrapper around c10's CPU allocator, installed with ``c10::SetCPUAllocator``: every
CPU tensor storage allocated afterwards, on any thread, is counted when it is allocated and
when it is freed. ``torch.profiler``'s memory events miss frees that gloo makes on its own worker
threads, so their running total drifts in multi-process runs; this count does not. It knows
nothing of tensors or categories: it is the ground truth a tracked (or predicted) per-rank peak
is checked against.

The extension is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (a C++
compiler, g++, is needed) and cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``).

    from vramledger import cpu_allocator_count as count
    count.install()        # before the tensors to count are allocated
    count.reset_peak(); ...; count.peak(), count.live()

Storages allocated before :func:`install` are freed through their own deleters and never
counted, so counts are differences from the moment of installing.
"""

from __future__ import annotations

import functools
import shutil
from types import ModuleType

from vramledger.inputs.errors import VramledgerError

EXTENSION_NAME = "vramledger_cpu_allocator_count"

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {

// Counts the bytes of every allocation made through it; frees go through `release`, which
// looks the size up by address (the base allocator's DataPtr carries no size).
class CountingAllocator final : public c10::Allocator {
 public:
  c10::Allocator* base = nullptr;
  c10::DeleterFnPtr base_deleter = nullptr;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    TORCH_CHECK(
        inner.get_context() == data && inner.get_deleter() == base_deleter,
        "cpu_allocator_count: the CPU allocator's DataPtr is not a plain pointer");
    c10::Device device = inner.device();
    inner.release_context();
    if (data != nullptr) {
      std::lock_guard<std::mutex> guard(mutex_);
      sizes_[data] = static_cast<int64_t>(nbytes);
    }
    add(static_cast<int64_t>(nbytes));
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void add(int64_t delta) {
    int64_t now = live.fetch_add(delta) + delta;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }

  static void release(void* data);

  int64_t forget(void* data) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = sizes_.find(data);
    if (it == sizes_.end()) return 0;
    int64_t nbytes = it->second;
    sizes_.erase(it);
    return nbytes;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, int64_t> sizes_;
};

CountingAllocator counting;

void CountingAllocator::release(void* data) {
  if (data == nullptr) return;
  counting.add(-counting.forget(data));
  counting.base_deleter(data);
}

}  // namespace

bool install() {
  if (counting.base != nullptr) return false;
  counting.base = c10::GetCPUAllocator();
  counting.base_deleter = counting.base->raw_deleter();
  TORCH_CHECK(counting.base_deleter != nullptr,
              "cpu_allocator_count: the CPU allocator has no raw deleter");
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  return true;
}

bool installed() { return counting.base != nullptr; }
int64_t live() { return counting.live.load(); }
int64_t peak() { return counting.peak.load(); }
void reset_peak() { counting.peak.store(counting.live.load()); }
"""

_FUNCTIONS = ["install", "installed", "live", "peak", "reset_peak"]


@functools.cache
def _extension() -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise VramledgerError(
            "counting the CPU allocator needs a C++ compiler (g++) to build a small extension",
            hint="install g++ (apt-get install g++), or compare against the tracked count",
        )
    try:
        return load_inline(
            name=EXTENSION_NAME, cpp_sources=_SOURCE, functions=_FUNCTIONS, verbose=False
        )
    except (RuntimeError, OSError) as exc:
        raise VramledgerError(
            f"building the CPU allocator counter failed: {str(exc).strip().splitlines()[-1]}",
            hint="check that g++ and the Python headers are installed",
        ) from exc


def build() -> None:
    """Compile (or load the cached build of) the extension without installing it."""
    _extension()


def install() -> None:
    """Count every CPU allocation from now on (idempotent)."""
    _extension().install()


def installed() -> bool:
    return bool(_extension().installed())


def live() -> int:
    """Bytes allocated since :func:`install` and not yet freed."""
    return int(_extension().live())


def peak() -> int:
    """The most :func:`live` has been since :func:`install` or the last :func:`reset_peak`."""
    return int(_extension().peak())


def reset_peak() -> None:
    _extension().reset_peak()
