// SPDX-License-Identifier: MIT
//! Runs N host replicas in lockstep, all-reduces a buffer between them and checks the result.
#include <lockstep/lockstep.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    const int replicas = argc > 1 ? std::atoi(argv[1]) : 4;
    const std::size_t count = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1000003;
    try {
        auto comms = lockstep::comm::HostCommunicator::create_group(replicas);
        lockstep::ReplicaPool pool(replicas);
        pool.attach(comms[0].group_ptr());
        std::vector<std::vector<double>> data(static_cast<std::size_t>(replicas), std::vector<double>(count));
        pool.run([&](int rank) {
            auto& mine = data[static_cast<std::size_t>(rank)];
            for (std::size_t i = 0; i < count; ++i) mine[i] = rank + 1.0 + static_cast<double>(i % 7);
            comms[static_cast<std::size_t>(rank)].all_reduce_sum(std::span<double>(mine));
        });
        const double n = replicas;
        for (std::size_t r = 0; r < data.size(); ++r)
            for (std::size_t i = 0; i < count; ++i)
                if (data[r][i] != n * (n + 1) / 2 + n * static_cast<double>(i % 7)) {
                    std::fprintf(stderr, "replica %zu element %zu: wrong sum %g\n", r, i, data[r][i]);
                    return 1;
                }
        std::printf("%d host replicas all-reduced %zu doubles in lockstep; every replica holds the same, correct sum\n", replicas,
                    count);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "hello_replicas: %s\n", e.what());
        return 2;
    }
}
