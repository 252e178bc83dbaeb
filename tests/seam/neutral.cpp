// SPDX-License-Identifier: MIT
//! The backend-neutral umbrellas compile without CBLAS: <cblas.h> on this test's include path is
//! an #error (tests/seam/cblas.h). A CUDA-only consumer includes these and <lockstep/cuda.cuh>.
#include <lockstep/nn.hpp>
#include <lockstep/parallel.hpp>

#include <type_traits>

namespace {
// Generic code names layers and DataParallel for any backend without instantiating one.
template <class B>
using Net = lockstep::nn::Sequential<lockstep::nn::Linear<B>, lockstep::nn::ReLU<B>>;
template <class B>
using Trainer = lockstep::DataParallel<Net<B>>;
static_assert(std::is_class_v<lockstep::nn::SoftmaxCrossEntropy>);
}  // namespace

int main() { return 0; }
