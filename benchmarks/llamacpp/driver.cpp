// The benchmark's llama.cpp driver: loads a model once, then greedy-decodes requests given as
// token ids on stdin, one per line ("<max_tokens> <id> <id> ..."), and answers each with one
// JSON line on stdout: {"tokens": [...], "prefill_s", "decode_s", "total_s", "n_drafted",
// "n_accepted", "n_steps"} (n_steps: the target forwards that gave tokens, so tokens / n_steps
// is the mean acceptance length). Token ids in and out keep tokenizers out of the comparison;
// it never stops at EOS (every request gets max_tokens tokens). An empty line or EOF ends it.
//
// Plain mode (no --spec-type): prefill, then one token per llama_decode, argmax of the logits.
// Speculative mode (--spec-type draft-mtp, with -md for a separate drafter such as the Gemma 4
// assistant): the speculative-simple example's loop (examples/speculative-simple), greedy
// (top-k 1), including its checkpoint / restore of recurrent state on partial acceptance.
// Every other option is llama.cpp's own (-m, -t, -tb, -c, --spec-draft-n-max, ...).

#include "arg.h"
#include "common.h"
#include "sampling.h"
#include "speculative.h"
#include "log.h"
#include "llama.h"

#include <algorithm>
#include <clocale>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

struct result {
    std::vector<llama_token> tokens;
    double prefill_s = 0, decode_s = 0;
    int n_drafted = 0, n_accepted = 0, n_steps = 0;
};

static double now_s() { return ggml_time_us() / 1e6; }

static llama_token argmax(llama_context * ctx, int n_vocab) {
    const float * logits = llama_get_logits_ith(ctx, -1);
    return (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
}

static result generate_plain(llama_context * ctx, int n_vocab, std::vector<llama_token> prompt, int n) {
    result r;
    llama_memory_clear(llama_get_memory(ctx), true);
    const double t0 = now_s();
    if (llama_decode(ctx, llama_batch_get_one(prompt.data(), (int32_t) prompt.size()))) {
        throw std::runtime_error("llama_decode failed on the prompt");
    }
    llama_token tok = argmax(ctx, n_vocab);
    r.tokens.push_back(tok);
    r.n_steps = 1;
    const double t1 = now_s();
    while ((int) r.tokens.size() < n) {
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1))) {
            throw std::runtime_error("llama_decode failed");
        }
        tok = argmax(ctx, n_vocab);
        r.tokens.push_back(tok);
        r.n_steps += 1;
    }
    r.prefill_s = t1 - t0;
    r.decode_s = now_s() - t1;
    return r;
}

// speculative-simple's loop, for one request; the speculator is made afresh per request.
static result generate_spec(common_params & params, llama_model * model_tgt, llama_context * ctx_tgt,
                            llama_context * ctx_dft, const std::vector<llama_token> & inp, int n) {
    result r;
    const llama_seq_id seq_id = 0;
    llama_memory_clear(llama_get_memory(ctx_tgt), true);
    if (ctx_dft) {
        llama_memory_clear(llama_get_memory(ctx_dft), true);
    }
    const bool use_ckpt_tgt = common_context_can_seq_rm(ctx_tgt) == COMMON_CONTEXT_SEQ_RM_TYPE_FULL;
    const bool use_ckpt_dft = common_context_can_seq_rm(ctx_dft) == COMMON_CONTEXT_SEQ_RM_TYPE_FULL;

    common_sampler_ptr smpl(common_sampler_init(model_tgt, params.sampling));
    common_speculative * spec = common_speculative_init(params.speculative, 1);
    if (spec == nullptr) {
        throw std::runtime_error("failed to initialize speculative decoding");
    }

    const double t0 = now_s();
    {
        common_batch batch_prompt(ctx_tgt);
        for (size_t i = 0; i + 1 < inp.size(); ++i) {
            batch_prompt.add(inp[i], i, seq_id, false);
        }
        llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch_prompt.get());
        if (!common_speculative_process(spec, batch_prompt)) {
            throw std::runtime_error("failed to process the speculative prompt");
        }
    }
    llama_token id_last = inp.back();
    llama_tokens prompt_tgt(inp.begin(), inp.end() - 1);
    int n_past = (int) inp.size() - 1;
    common_speculative_begin(spec, seq_id, prompt_tgt);
    common_batch batch_tgt(ctx_tgt);
    llama_tokens draft;
    common_prompt_checkpoint ckpt;
    const double t1 = now_s();   // the last prompt token goes with the first verification

    while ((int) r.tokens.size() < n) {
        if (draft.empty()) {
            ckpt.update_pos(prompt_tgt.size(),
                            llama_memory_seq_pos_min(llama_get_memory(ctx_tgt), seq_id),
                            llama_memory_seq_pos_max(llama_get_memory(ctx_tgt), seq_id));
            if (use_ckpt_dft) {
                ckpt.update_dft(ctx_dft, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
            }
            int n_draft_max = (int) llama_n_ctx(ctx_tgt) - n_past - 2;
            n_draft_max = std::max(0, std::min(n_draft_max, n - (int) r.tokens.size() - 1));
            common_speculative_get_draft_params(spec, seq_id) = {
                /* .drafting = */ true,
                /* .n_max    = */ n_draft_max,
                /* .pos0     = */ n_past,
                /* .id_last  = */ id_last,
                /* .prompt   = */ &prompt_tgt,
                /* .result   = */ &draft,
            };
            common_speculative_draft(spec);
            if (!draft.empty() && use_ckpt_tgt) {
                ckpt.update_tgt(ctx_tgt, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
            }
            if (ctx_dft) {
                if (use_ckpt_dft) {
                    ckpt.load_dft(ctx_dft, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
                }
                llama_memory_seq_rm(llama_get_memory(ctx_dft), seq_id, ckpt.pos_max + 1, -1);
            }
        }

        batch_tgt.clear();
        batch_tgt.add(id_last, n_past++, seq_id, true);
        for (size_t i = 0; i < draft.size(); ++i) {
            batch_tgt.add(draft[i], n_past + i, seq_id, true);
        }
        llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch_tgt.get());
        if (!common_speculative_process(spec, batch_tgt)) {
            throw std::runtime_error("failed to process the speculative batch");
        }

        common_sampler_ptr smpl_save;
        if (use_ckpt_tgt) {
            smpl_save.reset(common_sampler_clone(smpl.get()));
        }
        const size_t n_draft = draft.size();
        auto ids = common_sampler_sample_and_accept_n(smpl.get(), ctx_tgt, draft);

        // recurrent state cannot be cut back: restore the checkpoint and re-run the accepted part
        if (use_ckpt_tgt && ids.size() - 1 < n_draft) {
            draft = std::move(ids);
            ckpt.load_tgt(ctx_tgt, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
            llama_memory_seq_rm(llama_get_memory(ctx_tgt), seq_id, ckpt.pos_max + 1, -1);
            if (ctx_dft) {
                ckpt.load_dft(ctx_dft, seq_id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
                llama_memory_seq_rm(llama_get_memory(ctx_dft), seq_id, ckpt.pos_max + 1, -1);
            }
            prompt_tgt.resize(ckpt.n_tokens);
            smpl = std::move(smpl_save);
            n_past = (int) prompt_tgt.size();
            continue;
        }

        common_speculative_accept(spec, seq_id, ids.size() - 1);
        n_past += ids.size() - 1;
        r.n_drafted += n_draft;
        r.n_accepted += ids.size() - 1;
        r.n_steps += 1;
        for (llama_token id : ids) {
            prompt_tgt.push_back(id_last);
            id_last = id;
            r.tokens.push_back(id);
        }
        draft.clear();
        llama_memory_seq_rm(llama_get_memory(ctx_tgt), seq_id, n_past, -1);
        if (ctx_dft) {
            llama_memory_seq_rm(llama_get_memory(ctx_dft), seq_id, n_past, -1);
        }
    }
    r.tokens.resize(n);
    r.prefill_s = t1 - t0;
    r.decode_s = now_s() - t1;
    common_speculative_free(spec);
    return r;
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    common_params params;
    common_init();
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_SPECULATIVE)) {
        return 1;
    }
    // greedy: the one candidate top-k 1 leaves
    params.sampling.samplers = { COMMON_SAMPLER_TYPE_TOP_K };
    params.sampling.top_k = 1;
    const bool speculative = !params.speculative.types.empty() &&
        params.speculative.types != std::vector<common_speculative_type>{ COMMON_SPECULATIVE_TYPE_NONE };
    if (speculative) {
        const auto limits = common_speculative_get_output_limits(
            params.n_batch, params.n_parallel, common_speculative_n_max(&params.speculative));
        params.n_outputs_max = limits.total;
        params.n_outputs_max_per_seq = limits.per_seq;
    }

    llama_backend_init();
    llama_numa_init(params.numa);
    auto init_tgt = common_init_from_params(params);
    llama_model * model_tgt = init_tgt->model();
    llama_context * ctx_tgt = init_tgt->context();
    if (model_tgt == nullptr || ctx_tgt == nullptr) {
        fprintf(stderr, "failed to load the model\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model_tgt));

    common_speculative_init_result_ptr spec_init;
    llama_context * ctx_dft = nullptr;
    if (speculative) {
        common_params params_dft = common_base_params_to_speculative(params);
        spec_init = common_speculative_init_from_params(params_dft, model_tgt, ctx_tgt);
        params.speculative.draft.ctx_tgt = ctx_tgt;
        params.speculative.draft.ctx_dft = spec_init->context();
        ctx_dft = params.speculative.draft.ctx_dft;
    }
    printf("{\"ready\": true, \"mode\": \"%s\", \"n_vocab\": %d}\n", speculative ? "speculative" : "plain", n_vocab);
    fflush(stdout);

    std::string line;
    while (std::getline(std::cin, line) && !line.empty()) {
        std::istringstream in(line);
        int n = 0;
        in >> n;
        std::vector<llama_token> prompt;
        for (llama_token t; in >> t;) {
            prompt.push_back(t);
        }
        if (n <= 0 || prompt.empty()) {
            fprintf(stderr, "bad request: want \"<max_tokens> <id> <id> ...\"\n");
            return 1;
        }
        const double t0 = now_s();
        result r = speculative ? generate_spec(params, model_tgt, ctx_tgt, ctx_dft, prompt, n)
                               : generate_plain(ctx_tgt, n_vocab, prompt, n);
        const double total = now_s() - t0;
        std::string out = "{\"tokens\": [";
        for (size_t i = 0; i < r.tokens.size(); ++i) {
            out += (i ? ", " : "") + std::to_string(r.tokens[i]);
        }
        char tail[256];
        snprintf(tail, sizeof tail, "], \"prefill_s\": %.6f, \"decode_s\": %.6f, \"total_s\": %.6f, "
                 "\"n_drafted\": %d, \"n_accepted\": %d, \"n_steps\": %d}\n", r.prefill_s, r.decode_s,
                 total, r.n_drafted, r.n_accepted, r.n_steps);
        out += tail;
        fputs(out.c_str(), stdout);
        fflush(stdout);
    }
    llama_backend_free();
    return 0;
}
