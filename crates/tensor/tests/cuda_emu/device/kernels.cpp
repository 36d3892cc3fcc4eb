// The kernel half of the emulated CUDA device (see README.md beside this file): the tables of
// every kernel file's `extern "C"` kernels by name (each file compiled as host C++ against
// cuda_emu.h), device memory, and the products cuBLASLt would run, so that driver.cpp can
// answer cuModuleGetFunction, cuLaunchKernel, cuMemAlloc and cublasLtMatmul on the CPU.
#include "cuda_emu.h"
#include "emu_device.h"
#include "emu_registry.h"

#include <cstdio>
#include <cstring>
#include <vector>

// Each kernel file is its own translation unit (build.sh writes kernels_<file>.cpp: the
// file and its table, emu_kernels_<file>), as the emulator tests compile them: a
// `__shared__` variable of an inline function and one of a kernel may not share a section
// in one assembler file.
#include "kernel_tables.inc" // generated: EMU_DECLARE_TABLE(stem) for every kernel file

namespace {

struct Table {
    const emu_registry::Entry* entries;
    size_t count;
};

const std::vector<Table>& tables() {
    static const std::vector<Table> t = [] {
        std::vector<Table> v;
#undef EMU_DECLARE_TABLE
#define EMU_DECLARE_TABLE(stem)                                                              \
    {                                                                                        \
        size_t n = 0;                                                                        \
        const emu_registry::Entry* e = emu_kernels_##stem(&n);                              \
        v.push_back(Table{e, n});                                                            \
    }
#include "kernel_tables.inc"
#undef EMU_DECLARE_TABLE
        return v;
    }();
    return t;
}

void write_error(char* err, size_t len, const char* msg) {
    if (err && len) std::snprintf(err, len, "%s", msg);
}

} // namespace

extern "C" const void* emu_device_find_kernel(const char* name) {
    for (const Table& t : tables())
        for (size_t i = 0; i < t.count; ++i)
            if (std::strcmp(t.entries[i].name, name) == 0) return &t.entries[i];
    return nullptr;
}

extern "C" const char* emu_device_kernel_name(const void* kernel) {
    return static_cast<const emu_registry::Entry*>(kernel)->name;
}

extern "C" size_t emu_device_kernel_params(const void* kernel, const size_t** sizes) {
    const emu_registry::Entry* e = static_cast<const emu_registry::Entry*>(kernel);
    *sizes = e->param_sizes;
    return e->param_count;
}

extern "C" int emu_device_launch(const void* kernel, const unsigned grid[3],
                                 const unsigned block[3], size_t smem, void** params, char* err,
                                 size_t err_len) {
    const emu_registry::Entry* e = static_cast<const emu_registry::Entry*>(kernel);
    try {
        e->call(e->fn, dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2]), smem,
                params);
        return 0;
    } catch (const std::exception& ex) {
        write_error(err, err_len, ex.what());
        return 1;
    }
}

/// The emulator's own roundings (nearest even, from f64: no double rounding through f32).
extern "C" unsigned short emu_device_to_bf16(double v) {
    return emu::detail::round_to_small_float<8, 7>(v);
}
extern "C" unsigned short emu_device_to_f16(double v) {
    return emu::detail::round_to_small_float<5, 10>(v);
}
extern "C" float emu_device_from_bf16(unsigned short bits) {
    return emu::detail::bf16_bits_to_float(bits);
}
extern "C" float emu_device_from_f16(unsigned short bits) {
    return emu::detail::f16_bits_to_float(bits);
}

// ---------------------------------------------------------------------------------------
// Device memory: the emulator's guarded buffers (a write past the end is reported by the
// launch that makes it, an access further out faults and the crash handler names the buffer).

extern "C" void* emu_device_alloc(size_t bytes) {
    try {
        return emu::alloc<unsigned char>(bytes);
    } catch (const std::exception&) {
        return nullptr;
    }
}

extern "C" int emu_device_free(void* p) {
    try {
        emu::free(p);
        return 0;
    } catch (const std::exception&) {
        return 1;
    }
}
