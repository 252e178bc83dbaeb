// SPDX-License-Identifier: MIT
//! Must NOT compile: DataParallel of a module without backward() names what is missing.
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

struct NoBackward {
    using backend = lockstep::Host;
    lockstep::Tensor<float> forward(const lockstep::nn::Context<>&, lockstep::Tensor<float> x) { return x; }
    template <class V>
    void visit(V&&) {}
};

int main() { lockstep::DataParallel<NoBackward> dp(NoBackward{}, 2); }
