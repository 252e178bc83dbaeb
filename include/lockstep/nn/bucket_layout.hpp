// SPDX-License-Identifier: MIT
//! `nn::BucketLayout`: how DataParallel lays a replica's parameters out in flat buckets, the
//! layout it hands to the optimizer so that per-parameter state can be laid out alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lockstep::nn {

//! The flat buckets a replica's parameters live in (Note [gradients in their buckets] in
//! parallel/replica.hpp): each bucket holds some parameters at fixed offsets, their values and
//! gradients in two buffers laid out alike. Built once by DataParallel, the same for every
//! replica, and handed to the optimizer (`prepare(replicas, layout)`, Note [optimizer protocol]
//! in nn/sgd.hpp). Empty: no buckets, every parameter a tensor of its own.
struct BucketLayout {
    struct Bucket {
        std::vector<std::size_t> params;    //!< the parameters, by visit index, in visit order
        std::vector<std::int64_t> offsets;  //!< each one's first element in the bucket (64-byte aligned)
        std::int64_t size = 0;              //!< the bucket's elements, padding included
        friend bool operator==(const Bucket&, const Bucket&) = default;
    };
    std::vector<Bucket> buckets;  //!< in the order their all-reduces start (last layers first)

    //! The parameters the layout places.
    std::size_t parameters() const noexcept {
        std::size_t n = 0;
        for (const auto& b : buckets) n += b.params.size();
        return n;
    }
    bool empty() const noexcept { return buckets.empty(); }
    friend bool operator==(const BucketLayout&, const BucketLayout&) = default;
};

}  // namespace lockstep::nn
