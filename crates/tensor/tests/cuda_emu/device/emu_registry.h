// A kernel table entry of the emulated CUDA device: a kernel's name and a caller that unpacks
// cuLaunchKernel's `void** params` into the kernel's own parameter types, deduced from its
// signature, so no kernel's arguments are written out by hand.
#pragma once
#include "cuda_emu.h"

#include <cstddef>
#include <type_traits>
#include <utility>

namespace emu_registry {

struct Entry {
    const char* name;
    void (*call)(void* fn, dim3 grid, dim3 block, size_t smem, void** params);
    void* fn;
    /// The kernel's parameters' sizes, so a launch's arguments can be copied when it is
    /// queued and run later (the caller's `params` live only during the call).
    size_t param_count;
    const size_t* param_sizes;
};

template <class... P> struct ParamSizes {
    static constexpr size_t value[sizeof...(P) + 1] = {sizeof(std::decay_t<P>)..., 0};
};

template <class... P, size_t... I>
void call_unpacked(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, void** params,
                   std::index_sequence<I...>) {
    emu::launch(kernel, emu::GridArg(grid), block, smem,
                *static_cast<std::decay_t<P>*>(params[I])...);
}

template <class... P> void call(void* fn, dim3 grid, dim3 block, size_t smem, void** params) {
    call_unpacked(reinterpret_cast<void (*)(P...)>(fn), grid, block, smem, params,
                  std::index_sequence_for<P...>{});
}

template <class... P> Entry entry(const char* name, void (*kernel)(P...)) {
    return Entry{name, &call<P...>, reinterpret_cast<void*>(kernel), sizeof...(P),
                 ParamSizes<P...>::value};
}

} // namespace emu_registry

/// The table of one kernel file (`stem`: the file name without `.cu`).
#define EMU_DECLARE_TABLE(stem)                                                              \
    extern "C" const emu_registry::Entry* emu_kernels_##stem(size_t* count);
