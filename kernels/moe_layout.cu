// Where an MoE layer's rows go in the padded all-to-all (raypar/model/moe_exchange.py): one launch each side instead of some forty small torch ops, the
// host-side cost that bounded the MoE step. Every block first builds the small tables
// of counts in shared memory (E = ep * local experts <= MAX_EXPERTS), then each thread
// places one row. Every output element is written by exactly one thread, so no output
// needs filling beforehand.
#include "common.cuh"

#define MAX_EXPERTS 1024

// Sender. Slots are sorted by expert (`sorted_expert`, `order` the sort's permutation);
// rank r gets block r of `block` >= n rows, its slots first in sorted order, padding
// after (rows past n carry the block's counts: the caller writes them). A slot whose
// expert is E or more (dropped by the capacity) is sent nowhere and gets slot -1.
//   slots[order[i]] = row of sorted slot i, token[row] = order[i] / k,
//   row_weight[row] = weight[order[i]]; padding rows get token 0 and weight 0.
extern "C" __global__ void padded_send_layout(const i64* sorted_expert, const i64* order, const i64* send_counts,
                                              const float* weight, i64* slots, i64* token, float* row_weight,
                                              i64 n, i64 block, int k, int ep, int local) {
  __shared__ i64 first[MAX_EXPERTS + 1];  // first[r]: sorted slots before rank r's; first[ep]: all kept
  for (int r = threadIdx.x; r <= ep; r += blockDim.x) {
    i64 s = 0;
    for (int e = 0; e < r * local; ++e) s += send_counts[e];
    first[r] = s;
  }
  __syncthreads();
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (i64)ep * block) return;
  if (t < n) {
    const i64 slot = order[t];
    const i64 r = sorted_expert[t] / local;
    if (r < ep) {
      const i64 row = r * block + t - first[r];
      slots[slot] = row;
      token[row] = slot / k;
      row_weight[row] = weight[slot];
    } else {
      slots[slot] = -1;
    }
  }
  const i64 rank = t / block, j = t % block;
  if (j >= first[rank + 1] - first[rank]) {
    token[t] = 0;
    row_weight[t] = 0.f;
  }
}

// Receiver. Row i of the received [ep * n] rows is row j = i % n of source rank
// src = i / n's block: routed when j < that block's total, ordered by local expert within
// the block. Expert e's rows (from every source, lower ranks first) start at
// group_start[e], a multiple of `align`; padding rows go after every group.
//   position[i]: where row i goes in the [rows_n] expert input; source[p]: the received row
//   at p (0 for a gap); back[p]: the same, -1 for a gap; ends[e]: group e's end (int32).
extern "C" __global__ void padded_recv_layout(const i64* recv_counts, i64* position, int* ends, i64* source,
                                              i64* back, i64 n, int ep, int local, int align, i64 rows_n) {
  __shared__ int in_block_end[MAX_EXPERTS];   // [src][e]: rows of experts <= e in src's block
  __shared__ int before_source[MAX_EXPERTS];  // [src][e]: rows of e from ranks < src
  __shared__ int group_start[MAX_EXPERTS], group_rows[MAX_EXPERTS], group_end[MAX_EXPERTS];
  __shared__ i64 padding_before[MAX_EXPERTS + 1];  // [src]: padding rows of ranks < src
  __shared__ i64 padded_total;
  for (int e = threadIdx.x; e < local; e += blockDim.x) {
    int s = 0;
    for (int src = 0; src < ep; ++src) {
      before_source[src * local + e] = s;
      s += (int)recv_counts[src * local + e];
    }
    group_rows[e] = s;
  }
  for (int src = threadIdx.x; src < ep; src += blockDim.x) {
    int s = 0;
    for (int e = 0; e < local; ++e) {
      s += (int)recv_counts[src * local + e];
      in_block_end[src * local + e] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int start = 0;
    for (int e = 0; e < local; ++e) {
      group_start[e] = start;
      start += (group_rows[e] + align - 1) / align * align;
      group_end[e] = start;
    }
    padded_total = start;
    i64 p = 0;
    for (int src = 0; src < ep; ++src) {
      padding_before[src] = p;
      p += n - in_block_end[src * local + local - 1];
    }
    padding_before[ep] = p;
  }
  __syncthreads();
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (t < local && blockIdx.x == 0) ends[t] = group_end[t];
  if (t < (i64)ep * n) {
    const int src = (int)(t / n);
    const i64 j = t % n;
    const int* block_end = in_block_end + src * local;
    i64 p;
    if (j < block_end[local - 1]) {
      int e = 0;  // the first expert whose rows in this block end after j
      while (block_end[e] <= j) ++e;
      const int e_start = e == 0 ? 0 : block_end[e - 1];
      p = group_start[e] + before_source[src * local + e] + (j - e_start);
    } else {
      p = padded_total + padding_before[src] + (j - block_end[local - 1]);
    }
    position[t] = p;
    source[p] = t;
    back[p] = t;
  }
  if (t < rows_n) {
    bool gap;
    if (t < padded_total) {
      int e = 0;
      while (group_end[e] <= t) ++e;
      gap = t - group_start[e] >= group_rows[e];
    } else {
      gap = t >= padded_total + padding_before[ep];
    }
    if (gap) {
      source[t] = 0;
      back[t] = -1;
    }
  }
}
