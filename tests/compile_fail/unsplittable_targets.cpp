// SPDX-License-Identifier: MIT
//! Must NOT compile: targets DataParallel cannot split (labels of the wrong integer type); the
//! error says what it takes.
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

int main() {
    using namespace lockstep;
    nn::Sequential net(nn::Linear<>(4, 2));
    DataParallel dp(net, 2);
    nn::Sgd sgd({.lr = 0.1});
    dp.train_step(Tensor<float>(Shape{4, 4}), std::vector<int>{0, 1, 0, 1}, nn::SoftmaxCrossEntropy{}, sgd);
}
