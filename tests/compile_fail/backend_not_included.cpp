// SPDX-License-Identifier: MIT
// Host layers used with the layer kit alone, without <lockstep/host.hpp>: the seam's message
// says what to include.
#include <lockstep/nn.hpp>

int main() {
    lockstep::nn::Linear<lockstep::Host> fc(3, 2);
    lockstep::nn::Context<lockstep::Host> ctx;
    (void)fc.forward(ctx, lockstep::Tensor<float>(lockstep::Shape{4, 3}));
}
