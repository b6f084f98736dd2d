// config.json parsing for the four families of docs/numerics.md §1, key-name variants,
// errors (unknown model_type, every missing key, unsupported quantization),
// and config_json -> parse_config round trips.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "megamoe/model/config.h"

namespace megamoe {
namespace {

constexpr const char* kQuant = R"("quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                   "quant_method": "fp8", "weight_block_size": [128, 128]})";

std::string error_of(const std::string& text) {
  try {
    parse_config(text, "test/config.json");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Config, DeepSeekV3) {
  const std::string text = std::string(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "num_hidden_layers": 61, "num_nextn_predict_layers": 1, )") +
                           kQuant + "}";
  const ModelDesc d = parse_config(text);
  EXPECT_EQ(d.model_type, "deepseek_v3");
  EXPECT_EQ(d.family, "deepseek-v3");
  EXPECT_EQ(d.shape.hidden, 7168);
  EXPECT_EQ(d.shape.inter, 2048);
  EXPECT_EQ(d.shape.experts, 256);
  EXPECT_EQ(d.shape.topk, 8);
  EXPECT_EQ(d.shape.shared_experts, 1);
  EXPECT_EQ(d.shape.n_group, 8);
  EXPECT_EQ(d.shape.topk_group, 4);
  EXPECT_TRUE(d.shape.norm_topk_prob);
  EXPECT_FLOAT_EQ(d.shape.routed_scaling, 2.5f);
  EXPECT_EQ(d.shape.score, ScoreFunc::kSigmoid);
  EXPECT_EQ(d.shape.router_dtype, RouterDtype::kBF16);
  EXPECT_TRUE(d.shape.correction_bias);
  EXPECT_EQ(d.shape.swiglu_limit, 0.0f);
  EXPECT_EQ(d.num_layers, 61);
  ASSERT_EQ(d.moe_layers.size(), 58u);
  EXPECT_EQ(d.moe_layers.front(), 3);
  EXPECT_EQ(d.moe_layers.back(), 60);
  EXPECT_FALSE(d.is_moe_layer(2));
  EXPECT_TRUE(d.is_moe_layer(3));
  EXPECT_EQ(d.layer_prefix(5), "model.layers.5.mlp.");
  EXPECT_EQ(d.quant.block, (std::array<int, 2>{128, 128}));
  EXPECT_FALSE(d.quant.pow2_scales());
  // The MTP layer (num_nextn_predict_layers: 1) is model.layers.61: an MoE layer one asks
  // for by index, not one of the main layers.
  EXPECT_EQ(d.mtp_layers, std::vector<int>{61});
  EXPECT_TRUE(d.is_moe_layer(61));
  EXPECT_FALSE(d.is_moe_layer(62));
  EXPECT_EQ(d.layer_prefix(61), "model.layers.61.mlp.");
  EXPECT_EQ(d.moe_layers_text(), "3-60, MTP 61");
  try {
    d.require_moe_layer(2, "--layer");
    ADD_FAILURE() << "layer 2 is dense";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "--layer 2 is not an MoE layer of this deepseek-v3 model (MoE layers: 3-60, MTP 61)");
  }
}

TEST(Config, Glm5WithKeyVariants) {
  // num_experts / num_experts_per_token / moe_renormalize spellings; GLM configs omit fmt.
  const std::string text = R"({
    "model_type": "glm_moe_dsa", "hidden_size": 6144, "moe_intermediate_size": 2048,
    "num_experts": 256, "n_shared_experts": 1, "num_experts_per_token": 8,
    "moe_renormalize": false, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    "num_hidden_layers": 78,
    "quantization_config": {"activation_scheme": "dynamic", "quant_method": "fp8",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                            "modules_to_not_convert": ["lm_head"]}})";
  const ModelDesc d = parse_config(text);
  EXPECT_EQ(d.family, "glm-5");
  EXPECT_EQ(d.shape.hidden, 6144);
  EXPECT_EQ(d.shape.experts, 256);
  EXPECT_EQ(d.shape.topk, 8);
  EXPECT_FALSE(d.shape.norm_topk_prob);
  EXPECT_EQ(d.shape.n_group, 1);
  EXPECT_EQ(d.shape.router_dtype, RouterDtype::kF32);
  EXPECT_EQ(d.moe_layers.size(), 75u);
  EXPECT_TRUE(d.quant.pow2_scales());
  EXPECT_EQ(d.quant.fmt, "e4m3");
  EXPECT_EQ(d.quant.ignored_layers, std::vector<std::string>{"lm_head"});
}

TEST(Config, Glm47Flash) {
  const std::string text = std::string(R"({
    "model_type": "glm4_moe_lite", "hidden_size": 2048, "moe_intermediate_size": 1536,
    "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 1,
    "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 1.8,
    "first_k_dense_replace": 1, "num_hidden_layers": 47, )") +
                           kQuant + "}";
  const ModelDesc d = parse_config(text);
  EXPECT_EQ(d.family, "glm-4.7-flash");
  EXPECT_EQ(d.shape.experts, 64);
  EXPECT_EQ(d.shape.topk, 4);
  EXPECT_FLOAT_EQ(d.shape.routed_scaling, 1.8f);
  EXPECT_EQ(d.shape.router_dtype, RouterDtype::kF32);
  EXPECT_EQ(d.moe_layers.size(), 46u);
  EXPECT_EQ(d.layer_prefix(1), "model.layers.1.mlp.");
}

TEST(Config, Glm53FlashTextConfig) {
  std::string types;
  for (int l = 0; l < 45; ++l) types += std::string(l ? ", " : "") + (l < 3 ? "\"dense\"" : "\"sparse\"");
  const std::string text = R"({
    "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
    "vision_config": {"hidden_size": 1536, "depth": 24},
    "text_config": {
      "model_type": "glm5_next_text", "hidden_size": 4096, "moe_intermediate_size": 2048,
      "n_routed_experts": 288, "n_shared_experts": 1, "num_experts_per_tok": 8,
      "norm_topk_prob": true, "routed_scaling_factor": 2.5, "num_hidden_layers": 45,
      "mlp_layer_types": [)" +
                           types + R"(], "moe_router_dtype": "float32", "swiglu_limit": 10.0},
    )" + kQuant + "}";
  const ModelDesc d = parse_config(text);
  EXPECT_EQ(d.family, "glm-5.3-flash");
  EXPECT_EQ(d.shape.hidden, 4096);
  EXPECT_EQ(d.shape.experts, 288);
  EXPECT_EQ(d.shape.router_dtype, RouterDtype::kF32);
  EXPECT_FLOAT_EQ(d.shape.swiglu_limit, 10.0f);
  EXPECT_EQ(d.num_layers, 45);
  ASSERT_EQ(d.moe_layers.size(), 42u);
  EXPECT_EQ(d.moe_layers.front(), 3);
  EXPECT_EQ(d.layer_prefix(3), "model.language_model.layers.3.mlp.");
}

TEST(Config, MoeLayerFreqAndRouterOverride) {
  const std::string text = std::string(R"({
    "model_type": "deepseek_v3", "hidden_size": 256, "moe_intermediate_size": 128,
    "n_routed_experts": 8, "n_shared_experts": 0, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 2, "num_hidden_layers": 7,
    "moe_router_dtype": "float32", "scoring_func": "softmax", "topk_method": "greedy", )") +
                           kQuant + "}";
  const ModelDesc d = parse_config(text);
  EXPECT_EQ(d.moe_layers, (std::vector<int>{2, 4, 6}));
  EXPECT_EQ(d.shape.router_dtype, RouterDtype::kF32);
  EXPECT_EQ(d.shape.score, ScoreFunc::kSoftmax);
  EXPECT_FALSE(d.shape.correction_bias);
  EXPECT_FALSE(d.shape.has_shared());
}

TEST(Config, UnknownModelTypeNamesEveryMissingKey) {
  const std::string msg = error_of(R"({"model_type": "llama", "hidden_size": 4096})");
  EXPECT_NE(msg.find("test/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown model_type 'llama'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("deepseek_v3"), std::string::npos) << msg;  // lists the known ones
  for (const char* key : {"num_hidden_layers", "moe_intermediate_size", "n_routed_experts|num_experts",
                          "num_experts_per_tok|num_experts_per_token", "n_shared_experts",
                          "first_k_dense_replace|mlp_layer_types", "quantization_config"})
    EXPECT_NE(msg.find(key), std::string::npos) << key << " not in: " << msg;
  EXPECT_EQ(msg.find("'hidden_size'"), std::string::npos) << msg;  // present, so not reported
}

TEST(Config, MissingModelType) {
  const std::string msg = error_of(R"({"hidden_size": 4096})");
  EXPECT_NE(msg.find("missing key 'model_type'"), std::string::npos) << msg;
}

TEST(Config, WrongTypesAndDisagreeingVariants) {
  const std::string text = std::string(R"({
    "model_type": "deepseek_v3", "hidden_size": "7168", "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "num_hidden_layers": 61, "norm_topk_prob": 1, )") +
                           kQuant + "}";
  const std::string msg = error_of(text);
  EXPECT_NE(msg.find("'hidden_size' must be an integer, found \"7168\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("'num_experts' = 128 disagrees with 'n_routed_experts' = 256"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("norm_topk_prob|moe_renormalize' must be true or false"), std::string::npos) << msg;
}

TEST(Config, MlpLayerTypesValidated) {
  const std::string text = std::string(R"({
    "model_type": "glm5_next", "text_config": {"hidden_size": 256, "moe_intermediate_size": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "num_hidden_layers": 3,
    "mlp_layer_types": ["dense", "moe"]}, )") +
                           kQuant + "}";
  const std::string msg = error_of(text);
  EXPECT_NE(msg.find("'mlp_layer_types' has 2 entries, num_hidden_layers is 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mlp_layer_types[1] is \"moe\""), std::string::npos) << msg;
}

std::string small_config(const std::string& quant) {
  return R"({"model_type": "deepseek_v3", "hidden_size": 256, "moe_intermediate_size": 128,
             "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
             "first_k_dense_replace": 0, "num_hidden_layers": 2, "quantization_config": )" +
         quant + "}";
}

TEST(Config, QuantizationMustBeBlockFp8) {
  std::string msg = error_of(small_config(
      R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]})"));
  EXPECT_NE(msg.find("weight_block_size is [64, 64], expected [128, 128]"), std::string::npos) << msg;
  msg = error_of(small_config(R"({"quant_method": "gptq", "weight_block_size": [128, 128]})"));
  EXPECT_NE(msg.find("quant_method is 'gptq', expected 'fp8'"), std::string::npos) << msg;
  msg = error_of(small_config(R"({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})"));
  EXPECT_NE(msg.find("fmt is 'e5m2', expected 'e4m3'"), std::string::npos) << msg;
  msg = error_of(small_config(R"({"quant_method": "fp8", "activation_scheme": "static",
                                  "weight_block_size": [128, 128]})"));
  EXPECT_NE(msg.find("activation_scheme is 'static'"), std::string::npos) << msg;
  msg = error_of(small_config(R"({"quant_method": "fp8", "scale_fmt": "e8m0x",
                                  "weight_block_size": [128, 128]})"));
  EXPECT_NE(msg.find("scale_fmt is 'e8m0x'"), std::string::npos) << msg;
  msg = error_of(small_config(R"({"quant_method": "fp8"})"));
  EXPECT_NE(msg.find("missing key 'quantization_config.weight_block_size'"), std::string::npos) << msg;
  EXPECT_EQ(error_of(small_config(R"({"quant_method": "fp8", "weight_block_size": [128, 128]})")),
            "no error");
}

TEST(Config, InvalidJsonAndInvalidShape) {
  EXPECT_NE(error_of("{").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of("[]").find("expected a JSON object"), std::string::npos);
  // Parses, but top-k exceeds the experts: MoeShape::validate's message, with the file.
  std::string text = small_config(R"({"quant_method": "fp8", "weight_block_size": [128, 128]})");
  text.replace(text.find("\"num_experts_per_tok\": 2"), 24, "\"num_experts_per_tok\": 9");
  const std::string msg = error_of(text);
  EXPECT_NE(msg.find("test/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("top-k K = 9"), std::string::npos) << msg;
}

// Numbers a hostile config.json may hold: each is an error naming the key, never an
// allocation sized by it, a value cut to fit, or an infinite scale (before the fix the
// first was std::bad_alloc after an 8 GB layer list, the next three were accepted).
TEST(Config, OutOfRangeNumbers) {
  const std::string quant = R"({"quant_method": "fp8", "weight_block_size": [128, 128]})";
  auto with = [&](const std::string& key, const std::string& value) {
    std::string text = small_config(quant);
    const size_t at = text.find("\"" + key + "\"");
    if (at == std::string::npos) return text.insert(1, "\"" + key + "\": " + value + ", ");
    const size_t v0 = text.find(':', at) + 2, v1 = text.find_first_of(",}", v0);
    return text.replace(v0, v1 - v0, value);
  };
  auto expect = [&](const std::string& text, const std::string& needle) {
    const std::string msg = error_of(text);
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  };
  expect(with("num_hidden_layers", "2147483647"), "'num_hidden_layers' = 2147483647 must be in [1, 65536]");
  expect(with("num_hidden_layers", "-3"), "'num_hidden_layers' = -3 must be in [1, 65536]");
  expect(with("num_hidden_layers", "0"), "'num_hidden_layers' = 0 must be in [1, 65536]");
  expect(with("routed_scaling_factor", "1e300"),
         "'routed_scaling_factor' must be a finite number in float range");
  expect(with("routed_scaling_factor", "-2.5"), "routed_scaling = -2.5 must be finite and > 0");
  expect(with("swiglu_limit", "-1"), "swiglu_limit = -1 must be finite and >= 0");
  expect(with("hidden_size", "2097152"), "hidden size H = 2097152 must be in [1, 1048576]");
  expect(with("n_routed_experts", "1000000"), "experts E = 1000000 must be in [1, 16384]");
  expect(with("n_shared_experts", "100000"), "shared experts S = 100000 must be in [0, 64]");
  expect(small_config(R"({"quant_method": "fp8", "weight_block_size": [4294967424, 128]})"),
         "'quantization_config.weight_block_size' must be [rows, cols], found [4294967424,128]");
  expect(with("num_nextn_predict_layers", "-1"), "'num_nextn_predict_layers' = -1 must be in [0, 16]");
  expect(with("num_nextn_predict_layers", "17"), "'num_nextn_predict_layers' = 17 must be in [0, 16]");
  EXPECT_EQ(error_of(with("num_hidden_layers", "65536")), "no error");
}

// Nesting that a real config never has is refused while parsing: printing such a value in
// a message (or comparing two spellings of a key) recursed once a level, and 100000 levels
// under hidden_size crashed the process. Long values are cut in messages.
TEST(Config, DeepNestingAndLongValues) {
  const std::string quant = R"({"quant_method": "fp8", "weight_block_size": [128, 128]})";
  for (int depth : {33, 100000}) {
    std::string text = small_config(quant);
    text.replace(text.find("256"), 3, std::string(size_t(depth), '[') + std::string(size_t(depth), ']'));
    const std::string msg = error_of(text);
    EXPECT_NE(msg.find("test/config.json: nests deeper than 32 levels"), std::string::npos)
        << msg.substr(0, 200);
  }
  std::string text = small_config(quant);
  std::string list = "[0";
  for (int i = 1; i < 10000; ++i) list += fmt::format(",{}", i);
  text.replace(text.find("256"), 3, list + "]");
  const std::string msg = error_of(text);
  EXPECT_NE(msg.find("'hidden_size' must be an integer, found [0,1,2,"), std::string::npos) << msg;
  EXPECT_NE(msg.find("... (48891 characters)"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 400u);
}

TEST(Config, RoundTripEveryPreset) {
  for (const Preset& p : presets()) {
    SCOPED_TRACE(p.name);
    ModelDesc d = model_desc(p);
    d.quant.scale_fmt = "ue8m0";
    const ModelDesc back = parse_config(config_json(d), p.name);
    EXPECT_EQ(back.model_type, p.model_type);
    EXPECT_EQ(back.family, p.name);
    EXPECT_EQ(back.shape.describe(), p.shape.describe());
    EXPECT_EQ(back.shape.correction_bias, p.shape.correction_bias);
    EXPECT_EQ(back.num_layers, p.num_layers);
    EXPECT_EQ(back.moe_layers, d.moe_layers);
    EXPECT_EQ(back.layer_prefix_format, d.layer_prefix_format);
    EXPECT_TRUE(back.quant.pow2_scales());
    EXPECT_TRUE(back.mtp_layers.empty());
    // With two MTP layers after the main ones, in every family's key style.
    d.mtp_layers = {p.num_layers, p.num_layers + 1};
    EXPECT_EQ(parse_config(config_json(d), p.name).mtp_layers, d.mtp_layers);
  }
}

TEST(Config, LoadFromDirectory) {
  const auto dir = std::filesystem::temp_directory_path() / ("megamoe_config_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << config_json(model_desc(find_preset("glm-4.7-flash")));
  EXPECT_EQ(load_config(dir).family, "glm-4.7-flash");
  EXPECT_EQ(load_config(dir / "config.json").shape.experts, 64);
  std::filesystem::remove_all(dir);
  EXPECT_THROW(load_config(dir), ConfigError);
}

}  // namespace
}  // namespace megamoe
