// Test-only header: included by pkt_basic.cu so that editing it must change the cache key.
#pragma once
#define PKT_SCALE 2.0f
__device__ __forceinline__ float pkt_twice(float v) { return v * PKT_SCALE; }
