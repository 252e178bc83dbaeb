// SPDX-License-Identifier: MIT
// Stands in for CBLAS's header in the seam tests (tests/CMakeLists.txt): the backend-neutral
// headers must never include it.
#error "a backend-neutral lockstep header included <cblas.h>: only <lockstep/host.hpp> may (kernels/host_blas.hpp)"
