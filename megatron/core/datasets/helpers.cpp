/* Dataset index helpers (pybind11 module `megatron.core.datasets.helpers_cpp`).

   The functions build the integer index arrays the GPT, BERT/T5 and ICT datasets read samples
   through. They follow Megatron-LM core_r0.8.0's megatron/core/datasets/helpers.cpp:

   - build_sample_idx_int32 / build_sample_idx_int64: where every GPT sample starts, as rows
     (position in the document index, token offset inside that document).
   - build_blending_indices: greedy error-minimising assignment of blended samples to datasets.
   - build_exhaustive_blending_indices: the same greedy rule until every dataset is spent.
   - build_mapping: BERT/T5 sentence-span samples, shuffled with a seeded mt19937_64.
   - build_blocks_mapping: ICT/REALM blocks, shuffled the same way.

   Written for this project from the algorithm descriptions; no upstream code. */

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace {

constexpr int32_t LONG_SENTENCE_LEN = 512;

// Wrap a heap buffer into a numpy array that frees it when the array dies.
template <typename T>
py::array_t<T> owning_array(T *data, std::vector<py::ssize_t> shape) {
  py::capsule free_when_done(data, [](void *ptr) { delete[] reinterpret_cast<T *>(ptr); });
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = sizeof(T);
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return py::array_t<T>(shape, strides, data, free_when_done);
}

/* Sample index for GPT: row j = (index into document_idx, offset into that document) where
   sample j starts. Each sample spans sequence_length + add_extra_token tokens; consecutive samples
   overlap by add_extra_token tokens. */
template <typename T>
py::array_t<T> build_sample_idx_impl(const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes_,
                                     const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &document_idx_,
                                     const int32_t sequence_length, const int32_t num_epochs,
                                     const int64_t tokens_per_epoch, const bool drop_last_partial_sequence,
                                     const int add_extra_token_to_sequence) {
  if (sequence_length <= 0) throw std::invalid_argument("build_sample_idx: sequence_length must be > 0");
  if (num_epochs <= 0) throw std::invalid_argument("build_sample_idx: num_epochs must be > 0");
  if (tokens_per_epoch < 0) throw std::invalid_argument("build_sample_idx: tokens_per_epoch must be >= 0");
  const int32_t *sizes = sizes_.data();
  const int32_t *document_idx = document_idx_.data();
  const int64_t num_sizes = sizes_.size();
  const int64_t num_docs = document_idx_.size();
  const int64_t extra = add_extra_token_to_sequence;

  const int64_t total_tokens = static_cast<int64_t>(num_epochs) * tokens_per_epoch - extra;
  int64_t num_samples;
  if (drop_last_partial_sequence) {
    num_samples = total_tokens / sequence_length;
  } else {
    num_samples = (total_tokens + sequence_length - 1) / sequence_length;
  }
  if (num_samples < 0) num_samples = 0;

  T *sample_idx = new T[2 * (num_samples + 1)];
  int64_t sample_index = 0;
  int64_t document_idx_index = 0;
  int64_t doc_offset = 0;
  sample_idx[2 * sample_index] = static_cast<T>(document_idx_index);
  sample_idx[2 * sample_index + 1] = static_cast<T>(doc_offset);
  ++sample_index;

  while (sample_index <= num_samples) {
    int64_t remaining = sequence_length + extra;
    while (remaining != 0) {
      if (document_idx_index >= num_docs) {
        delete[] sample_idx;
        throw std::runtime_error("build_sample_idx: ran past the end of the document index");
      }
      const int32_t doc_id = document_idx[document_idx_index];
      if (doc_id < 0 || doc_id >= num_sizes) {
        delete[] sample_idx;
        throw std::out_of_range("build_sample_idx: document id out of range of sizes");
      }
      const int64_t doc_length = static_cast<int64_t>(sizes[doc_id]) - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The next sample starts `extra` tokens before this one ends.
        doc_offset += (remaining + doc_length - extra);
        remaining = 0;
      } else {
        if (document_idx_index == num_docs - 1) {
          // Last document and the sample is partial (only when not dropping it).
          doc_offset = static_cast<int64_t>(sizes[doc_id]) - extra;
          break;
        }
        ++document_idx_index;
        doc_offset = 0;
      }
    }
    sample_idx[2 * sample_index] = static_cast<T>(document_idx_index);
    sample_idx[2 * sample_index + 1] = static_cast<T>(doc_offset);
    ++sample_index;
  }
  return owning_array<T>(sample_idx, {static_cast<py::ssize_t>(num_samples + 1), 2});
}

py::array_t<int32_t> build_sample_idx_int32(const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes,
                                            const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &document_idx,
                                            int32_t sequence_length, int32_t num_epochs, int64_t tokens_per_epoch,
                                            bool drop_last_partial_sequence, int add_extra_token_to_sequence) {
  return build_sample_idx_impl<int32_t>(sizes, document_idx, sequence_length, num_epochs, tokens_per_epoch,
                                        drop_last_partial_sequence, add_extra_token_to_sequence);
}

py::array_t<int64_t> build_sample_idx_int64(const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes,
                                            const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &document_idx,
                                            int32_t sequence_length, int32_t num_epochs, int64_t tokens_per_epoch,
                                            bool drop_last_partial_sequence, int add_extra_token_to_sequence) {
  return build_sample_idx_impl<int64_t>(sizes, document_idx, sequence_length, num_epochs, tokens_per_epoch,
                                        drop_last_partial_sequence, add_extra_token_to_sequence);
}

/* Greedy blending: sample s goes to the dataset whose achieved count lags its target
   weight * max(s, 1) the most (ties -> lowest index). Fills the two output arrays in place. */
void build_blending_indices(py::array_t<int16_t> &dataset_index, py::array_t<int64_t> &dataset_sample_index,
                            const py::array_t<double, py::array::c_style | py::array::forcecast> &weights,
                            const int32_t num_datasets, const int64_t size, const bool verbose) {
  if (verbose) std::cout << "> building indices for blended datasets ..." << std::endl;
  if (num_datasets <= 0) throw std::invalid_argument("build_blending_indices: num_datasets must be > 0");
  if (weights.size() < num_datasets) throw std::invalid_argument("build_blending_indices: too few weights");
  if (dataset_index.size() < size || dataset_sample_index.size() < size)
    throw std::invalid_argument("build_blending_indices: output arrays shorter than size");
  auto out_index = dataset_index.mutable_unchecked<1>();
  auto out_sample = dataset_sample_index.mutable_unchecked<1>();
  auto w = weights.unchecked<1>();
  std::vector<int64_t> current_samples(num_datasets, 0);

  for (int64_t sample_idx = 0; sample_idx < size; ++sample_idx) {
    const double sample_idx_double = std::max(static_cast<double>(sample_idx), 1.0);
    int64_t max_error_index = 0;
    double max_error = w(0) * sample_idx_double - static_cast<double>(current_samples[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double error = w(d) * sample_idx_double - static_cast<double>(current_samples[d]);
      if (error > max_error) {
        max_error = error;
        max_error_index = d;
      }
    }
    out_index(sample_idx) = static_cast<int16_t>(max_error_index);
    out_sample(sample_idx) = current_samples[max_error_index];
    current_samples[max_error_index] += 1;
  }

  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int64_t d = 0; d < num_datasets; ++d) {
      const double ratio = static_cast<double>(current_samples[d]) / static_cast<double>(size);
      std::cout << "   dataset " << d << ", input: " << w(d) << ", achieved: " << ratio << std::endl;
    }
  }
}

/* Exhaustive blending: weights are the normalised sizes; a dataset leaves the candidate set once
   it has produced sizes[d] samples. Output length is sum(sizes). */
void build_exhaustive_blending_indices(py::array_t<int16_t> &dataset_index, py::array_t<int64_t> &dataset_sample_index,
                                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &sizes,
                                       const int32_t num_datasets) {
  auto s = sizes.unchecked<1>();
  int64_t total_size = 0;
  for (int64_t d = 0; d < num_datasets; ++d) total_size += s(d);
  if (dataset_index.size() < total_size || dataset_sample_index.size() < total_size)
    throw std::invalid_argument("build_exhaustive_blending_indices: output arrays shorter than sum(sizes)");
  auto out_index = dataset_index.mutable_unchecked<1>();
  auto out_sample = dataset_sample_index.mutable_unchecked<1>();
  std::vector<double> weights(num_datasets);
  for (int64_t d = 0; d < num_datasets; ++d) weights[d] = static_cast<double>(s(d)) / static_cast<double>(total_size);
  std::vector<int64_t> counts(num_datasets, 0);

  for (int64_t sample_idx = 0; sample_idx < total_size; ++sample_idx) {
    const double sample_idx_double = std::max(static_cast<double>(sample_idx), 1.0);
    int64_t argmax = -1;
    double max_error = std::numeric_limits<double>::lowest();
    for (int64_t d = 0; d < num_datasets; ++d) {
      if (counts[d] < s(d)) {
        const double error = weights[d] * sample_idx_double - static_cast<double>(counts[d]);
        if (argmax < 0 || error > max_error) {
          max_error = error;
          argmax = d;
        }
      }
    }
    out_index(sample_idx) = static_cast<int16_t>(argmax);
    out_sample(sample_idx) = counts[argmax];
    counts[argmax] += 1;
  }
}

// BERT/T5 target length: max_length, or with probability ~1/ratio a random length in [2, max_length].
inline int32_t get_target_sample_len(const int32_t short_seq_ratio, const int32_t max_length, std::mt19937 &rand32_gen) {
  if (short_seq_ratio == 0) return max_length;
  const uint32_t random_number = rand32_gen();
  if ((random_number % short_seq_ratio) == 0) return 2 + static_cast<int32_t>(random_number % (max_length - 1));
  return max_length;
}

template <typename DocIdx>
py::array build_mapping_impl(const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &docs_,
                             const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes_,
                             const int32_t num_epochs, const uint64_t max_num_samples, const int32_t max_seq_length,
                             const double short_seq_prob, const int32_t seed, const bool verbose,
                             const int32_t min_num_sent) {
  if (num_epochs <= 0) throw std::invalid_argument("build_mapping: num_epochs must be > 0");
  if (max_seq_length <= 1) throw std::invalid_argument("build_mapping: max_seq_length must be > 1");
  if (short_seq_prob < 0.0 || short_seq_prob > 1.0) throw std::invalid_argument("build_mapping: short_seq_prob not in [0, 1]");
  auto docs = docs_.unchecked<1>();
  auto sizes = sizes_.unchecked<1>();
  int32_t short_seq_ratio = 0;
  if (short_seq_prob > 0) short_seq_ratio = static_cast<int32_t>(std::round(1.0 / short_seq_prob));
  if (verbose) {
    std::cout << " > building sample map using " << num_epochs << " epochs and up to " << max_num_samples
              << " samples, max sequence length " << max_seq_length << ", short sequence ratio " << short_seq_ratio
              << ", seed " << seed << std::endl;
  }

  int64_t num_samples = 0;
  DocIdx *maps = nullptr;
  for (int iteration = 0; iteration < 2; ++iteration) {
    const bool second = iteration == 1;
    std::mt19937 rand32_gen(seed);
    uint64_t map_index = 0;
    for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
      if (map_index >= max_num_samples) break;
      for (int64_t doc = 0; doc < docs.shape(0) - 1; ++doc) {
        const int64_t sent_index_first = docs(doc);
        const int64_t sent_index_last = docs(doc + 1);
        int64_t prev_start_index = sent_index_first;
        int64_t num_remain_sent = sent_index_last - sent_index_first;
        bool contains_long_sentence = false;
        if (num_remain_sent > 1) {
          for (int64_t sent_index = sent_index_first; sent_index < sent_index_last; ++sent_index) {
            if (sizes(sent_index) > LONG_SENTENCE_LEN) {
              contains_long_sentence = true;
              break;
            }
          }
        }
        if (num_remain_sent >= min_num_sent && !contains_long_sentence) {
          int64_t seq_len = 0;
          int32_t num_sent = 0;
          int32_t target_seq_len = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen);
          for (int64_t sent_index = sent_index_first; sent_index < sent_index_last; ++sent_index) {
            seq_len += sizes(sent_index);
            ++num_sent;
            --num_remain_sent;
            if ((seq_len >= target_seq_len && num_remain_sent > 1 && num_sent >= min_num_sent) || num_remain_sent == 0) {
              if (second) {
                maps[3 * map_index] = static_cast<DocIdx>(prev_start_index);
                maps[3 * map_index + 1] = static_cast<DocIdx>(sent_index + 1);
                maps[3 * map_index + 2] = static_cast<DocIdx>(target_seq_len);
              }
              ++map_index;
              prev_start_index = sent_index + 1;
              target_seq_len = get_target_sample_len(short_seq_ratio, max_seq_length, rand32_gen);
              seq_len = 0;
              num_sent = 0;
            }
          }
        }
      }
    }
    if (!second) {
      num_samples = static_cast<int64_t>(map_index);
      maps = new DocIdx[3 * std::max<int64_t>(num_samples, 1)];
    }
  }

  std::mt19937_64 rand64_gen(seed + 1);
  for (int64_t i = num_samples - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rand64_gen() % static_cast<uint64_t>(i + 1));
    for (int k = 0; k < 3; ++k) std::swap(maps[3 * i + k], maps[3 * j + k]);
  }
  if (verbose) std::cout << "    number of samples: " << num_samples << std::endl;
  return owning_array<DocIdx>(maps, {static_cast<py::ssize_t>(num_samples), 3});
}

py::array build_mapping(const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &docs,
                        const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes,
                        const int num_epochs, const uint64_t max_num_samples, const int max_seq_length,
                        const double short_seq_prob, const int seed, const bool verbose, const int32_t min_num_sent) {
  if (sizes.size() > std::numeric_limits<uint32_t>::max()) {
    return build_mapping_impl<uint64_t>(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                                        verbose, min_num_sent);
  }
  return build_mapping_impl<uint32_t>(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed,
                                      verbose, min_num_sent);
}

template <typename DocIdx>
py::array build_blocks_mapping_impl(const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &docs_,
                                    const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes_,
                                    const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &titles_sizes_,
                                    const int32_t num_epochs, const uint64_t max_num_samples,
                                    const int32_t max_seq_length, const int32_t seed, const bool verbose,
                                    const bool use_one_sent_blocks) {
  if (num_epochs <= 0) throw std::invalid_argument("build_blocks_mapping: num_epochs must be > 0");
  if (max_seq_length <= 1) throw std::invalid_argument("build_blocks_mapping: max_seq_length must be > 1");
  auto docs = docs_.unchecked<1>();
  auto sizes = sizes_.unchecked<1>();
  auto titles_sizes = titles_sizes_.unchecked<1>();
  const int32_t min_num_sent = use_one_sent_blocks ? 1 : 2;

  int64_t num_samples = 0;
  DocIdx *maps = nullptr;
  for (int iteration = 0; iteration < 2; ++iteration) {
    const bool second = iteration == 1;
    uint64_t map_index = 0;
    uint64_t block_id = 0;
    for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
      if (map_index >= max_num_samples) break;
      for (int64_t doc = 0; doc < docs.shape(0) - 1; ++doc) {
        const int64_t sent_index_first = docs(doc);
        const int64_t sent_index_last = docs(doc + 1);
        const int64_t target_seq_len = max_seq_length - titles_sizes(doc);
        int64_t prev_start_index = sent_index_first;
        int64_t num_remain_sent = sent_index_last - sent_index_first;
        bool contains_long_sentence = false;
        if (num_remain_sent >= min_num_sent) {
          for (int64_t sent_index = sent_index_first; sent_index < sent_index_last; ++sent_index) {
            if (sizes(sent_index) > LONG_SENTENCE_LEN) {
              contains_long_sentence = true;
              break;
            }
          }
        }
        if (num_remain_sent >= min_num_sent && !contains_long_sentence) {
          int64_t seq_len = 0;
          int32_t num_sent = 0;
          for (int64_t sent_index = sent_index_first; sent_index < sent_index_last; ++sent_index) {
            seq_len += sizes(sent_index);
            ++num_sent;
            --num_remain_sent;
            if ((seq_len >= target_seq_len && num_remain_sent >= min_num_sent && num_sent >= min_num_sent) ||
                num_remain_sent == 0) {
              if (second) {
                maps[4 * map_index] = static_cast<DocIdx>(prev_start_index);
                maps[4 * map_index + 1] = static_cast<DocIdx>(sent_index + 1);
                maps[4 * map_index + 2] = static_cast<DocIdx>(doc);
                maps[4 * map_index + 3] = static_cast<DocIdx>(block_id);
              }
              ++block_id;
              ++map_index;
              prev_start_index = sent_index + 1;
              seq_len = 0;
              num_sent = 0;
            }
          }
        }
      }
    }
    if (!second) {
      num_samples = static_cast<int64_t>(map_index);
      maps = new DocIdx[4 * std::max<int64_t>(num_samples, 1)];
    }
  }

  std::mt19937_64 rand64_gen(seed + 1);
  for (int64_t i = num_samples - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rand64_gen() % static_cast<uint64_t>(i + 1));
    for (int k = 0; k < 4; ++k) std::swap(maps[4 * i + k], maps[4 * j + k]);
  }
  if (verbose) std::cout << "    number of blocks: " << num_samples << std::endl;
  return owning_array<DocIdx>(maps, {static_cast<py::ssize_t>(num_samples), 4});
}

py::array build_blocks_mapping(const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &docs,
                               const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes,
                               const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &titles_sizes,
                               const int num_epochs, const uint64_t max_num_samples, const int max_seq_length,
                               const int seed, const bool verbose, const bool use_one_sent_blocks) {
  if (sizes.size() > std::numeric_limits<uint32_t>::max()) {
    return build_blocks_mapping_impl<uint64_t>(docs, sizes, titles_sizes, num_epochs, max_num_samples, max_seq_length,
                                               seed, verbose, use_one_sent_blocks);
  }
  return build_blocks_mapping_impl<uint32_t>(docs, sizes, titles_sizes, num_epochs, max_num_samples, max_seq_length,
                                             seed, verbose, use_one_sent_blocks);
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "Index builders for megatron.core.datasets (see helpers.py for the Python-facing wrapper).";
  m.def("build_sample_idx_int32", &build_sample_idx_int32, py::arg("sizes"), py::arg("document_idx"),
        py::arg("sequence_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_sample_idx_int64", &build_sample_idx_int64, py::arg("sizes"), py::arg("document_idx"),
        py::arg("sequence_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_blending_indices", &build_blending_indices);
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices);
  m.def("build_mapping", &build_mapping);
  m.def("build_blocks_mapping", &build_blocks_mapping);
}
