// Weights packed for oneDNN's brgemm in blocks of NBLK output columns (bf16
// in VNNI pairs, [N/NBLK][K/2][NBLK][2]: brgemm.cpp's pack_bf16; int8 alike),
// and at most MBLK activation rows a brgemm call: shared by the GEMMs that
// read them (brgemm.cpp, screen.cpp).
#pragma once

namespace sf {

constexpr int NBLK = 64;
constexpr int MBLK = 32;

}  // namespace sf
