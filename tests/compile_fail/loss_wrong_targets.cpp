// SPDX-License-Identifier: MIT
//! Must NOT compile: a classification loss handed regression targets; the error says which loss
//! takes which targets.
#include <lockstep/nn.hpp>
#include <lockstep/host.hpp>
#include <lockstep/parallel.hpp>

int main() {
    using namespace lockstep;
    nn::Sequential net(nn::Linear<>(4, 2));
    DataParallel dp(net, 2);
    nn::Sgd sgd({.lr = 0.1});
    dp.train_step(Tensor<float>(Shape{4, 4}), Tensor<float>(Shape{4, 2}), nn::SoftmaxCrossEntropy{}, sgd);
}
