// SPDX-License-Identifier: MIT
//! Runs two host replicas and all-reduces through an installed lockstep; exits non-zero on a wrong sum.
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <vector>

int main() {
    auto comms = lockstep::comm::HostCommunicator::create_group(2);
    lockstep::ReplicaPool pool(2);
    std::vector<std::vector<double>> data(2, std::vector<double>(5));
    pool.run([&](int rank) {
        for (auto& v : data[rank]) v = rank + 1.0;
        comms[rank].all_reduce_sum(std::span<double>(data[rank]));
    });
    for (const auto& d : data)
        for (double v : d)
            if (v != 3.0) {
                std::fprintf(stderr, "consumer: expected 3, got %g\n", v);
                return 1;
            }
    std::puts("consumer: all-reduce through the installed lockstep package is correct");
    return 0;
}
