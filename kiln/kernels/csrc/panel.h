// What kiln's panel GEMMs share (`kiln.kernels.panel_linear`): the weight packed in panels of KILN_PANEL output
// channels, each panel's K x 16 block contiguous, and up to 16 token rows of x in registers. Both kernels may
// land in one piece's wrapper: the guard keeps this once.
#ifndef KILN_PANEL_H
#define KILN_PANEL_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

// Output channels a panel holds: one AVX-512 register of fp32 (panel_linear.PANEL)
#define KILN_PANEL 16
// How far ahead of the row being multiplied a kernel prefetches its weight, in 64-byte lines
// (panel_linear.PREFETCH_LINES)
#define KILN_PREFETCH_LINES 256
// X(i) for each of the 16 token rows a kernel keeps in registers
#define KILN_PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

#endif  // KILN_PANEL_H
