// The hardware limits v2's tiles are sized and checked against (CUDA C++ Programming Guide, "Technical
// Specifications per Compute Capability", sm_80 and sm_90) and the mma shape they are cut into. Host-compilable: the
// tile table's static_asserts, the kernel traits and the launchers read them; a limit that differs between archs
// names the arch it is for.
#pragma once

namespace flashgen {
namespace v2 {

constexpr int kMaxThreadsPerSm = 2048;    // resident threads per SM (sm_80, sm_90)
constexpr int kRegistersPerSm = 65536;    // 32-bit registers per SM (sm_80, sm_90)
constexpr int kMaxRegsPerThread = 255;    // registers one thread can address
constexpr int kSmemPerSm = 228 * 1024;    // shared memory per SM on sm_90 (sm_80: 164 KB)
constexpr int kSmemReservedPerCta = 1024; // shared memory the system reserves per resident CTA (sm_80, sm_90)
constexpr int kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit per CTA (sm_80: 163 KB; checked at launch)
constexpr int kDefaultSmemLimit = 48 * 1024;  // dynamic shared memory above this needs the opt-in attribute
constexpr int kMmaM = 16;                 // rows of one mma.sync m16n8k16 tile: the smallest query block

}  // namespace v2
}  // namespace flashgen
