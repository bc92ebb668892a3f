// TensorRT IPluginV3 plugin "KVzapThresholdCompaction" (namespace "kvzap", version "1"): the op of the bundle's
// compaction/threshold_compaction_plugin.onnx node, enqueuing the CUDA kernels of libkvzap_kernels
// (include/kvzap/compaction.h).
//
// Inputs  scores [B,H,T] float32|float16|bfloat16, lengths [B] int32, threshold [] float32, window [] int32.
// Outputs keep [B,H,T] int32 (0/1), counts [B,H] int32, indices [B,H,T] int32. Field: sink (int32, >= 0).
// keep is int32, not bool: TensorRT plugins cannot output DataType::kBOOL (see getOutputDataTypes in
// NvInferRuntime.h); an ONNX Cast node after the plugin gives the bool the bundle's contract promises.
//
// Written against TensorRT 10.x / 11.x NvInferRuntime.h (checked to compile against the public headers of 10.0,
// 10.8, 10.16 and 11.1). Loading:
// - default build: exports getCreators/setLoggerFinder, the entry points of IPluginRegistry::loadLibrary
//   (trt.get_plugin_registry().load_library(path)), `trtexec --dynamicPlugins=path` and plugin libraries
//   serialized into version-compatible engines. It needs no libnvinfer symbols.
// - KVZAP_STATIC_REGISTRATION: registers the creator when the library is loaded (ctypes.CDLL, `polygraphy
//   --plugins`), links libnvinfer, and exports no getCreators: loadLibrary fails for a library whose plugins are
//   already registered, so one library cannot serve both ways.
#include "kvzap/compaction.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <new>

#define KVZAP_EXPORT extern "C" __attribute__((visibility("default")))

using namespace nvinfer1;

namespace {

constexpr char const* kName = "KVzapThresholdCompaction";
constexpr char const* kVersion = "1";
constexpr char const* kNamespace = "kvzap";
constexpr char const* kSinkField = "sink";
constexpr int32_t kNbInputs = 4;
constexpr int32_t kNbOutputs = 3;
// Positions in the inOut arrays TensorRT passes: inputs first, then outputs.
enum Position : int32_t { kScores = 0, kLengths, kThreshold, kWindow, kKeep, kCounts, kIndices };

ILoggerFinder* gLoggerFinder = nullptr;

void logError(char const* message) noexcept {
  if (gLoggerFinder == nullptr) return;
  ILogger* logger = gLoggerFinder->findLogger();
  if (logger != nullptr) logger->log(ILogger::Severity::kERROR, message);
}

bool isScoresType(DataType type) {
  return type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16;
}

class KVzapPlugin final : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime {
 public:
  explicit KVzapPlugin(int32_t sink) : mSink(sink) {
    mField = PluginField(kSinkField, &mSink, PluginFieldType::kINT32, 1);
    mFields.nbFields = 1;
    mFields.fields = &mField;
  }
  KVzapPlugin(KVzapPlugin const&) = delete;  // mField points into this object
  KVzapPlugin& operator=(KVzapPlugin const&) = delete;

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override { return new (std::nothrow) KVzapPlugin(mSink); }

  // IPluginV3OneCore
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return kNbOutputs; }

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || !isScoresType(inputTypes[kScores])) {
      logError("KVzapThresholdCompaction: expects inputs (scores float32|float16|bfloat16, lengths, threshold, window)");
      return -1;
    }
    outputTypes[0] = DataType::kINT32;  // keep (0/1)
    outputTypes[1] = DataType::kINT32;  // counts
    outputTypes[2] = DataType::kINT32;  // indices
    return 0;
  }

  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[kScores].nbDims != 3 || inputs[kLengths].nbDims != 1) {
      logError("KVzapThresholdCompaction: scores must be [batch, heads, seq] and lengths [batch]");
      return -1;
    }
    outputs[0] = inputs[kScores];  // keep    [B, H, T]
    outputs[1].nbDims = 2;         // counts  [B, H]
    outputs[1].d[0] = inputs[kScores].d[0];
    outputs[1].d[1] = inputs[kScores].d[1];
    outputs[2] = inputs[kScores];  // indices [B, H, T]
    return 0;
  }

  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs) return false;
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR) return false;
    switch (pos) {
      case kScores: return isScoresType(desc.type);
      case kThreshold: return desc.type == DataType::kFLOAT;
      default: return desc.type == DataType::kINT32;  // lengths, window, keep, counts, indices
    }
  }

  int32_t configurePlugin(DynamicPluginTensorDesc const* /*in*/, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/,
                          int32_t nbOutputs) noexcept override {
    return nbInputs == kNbInputs && nbOutputs == kNbOutputs ? 0 : -1;
  }

  size_t getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                          DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept override {
    return 0;
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                        int32_t nbOutputs) noexcept override {
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || in[kScores].dims.nbDims != 3) return -1;
    // The kernels index with int: refuse shapes they cannot address.
    Dims const& d = in[kScores].dims;
    int64_t const limit = std::numeric_limits<int32_t>::max();
    return (d.d[0] * d.d[1] <= limit && d.d[2] <= limit) ? 0 : -1;
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/, void const* const* inputs,
                  void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept override {
    Dims const& d = inputDesc[kScores].dims;
    int scoresDtype = KVZAP_FLOAT32;
    if (inputDesc[kScores].type == DataType::kHALF) scoresDtype = KVZAP_FLOAT16;
    if (inputDesc[kScores].type == DataType::kBF16) scoresDtype = KVZAP_BFLOAT16;
    if (d.d[0] == 0 || d.d[1] == 0) return 0;  // empty batch: nothing to write
    int const status = kvzap_threshold_compaction(
        inputs[kScores], scoresDtype, static_cast<int32_t const*>(inputs[kLengths]),
        static_cast<float const*>(inputs[kThreshold]), static_cast<int32_t const*>(inputs[kWindow]),
        static_cast<int>(d.d[0]), static_cast<int>(d.d[1]), static_cast<int>(d.d[2]), mSink, outputs[0], KVZAP_INT32,
        static_cast<int32_t*>(outputs[1]), static_cast<int32_t*>(outputs[2]), stream);
    if (status != 0) logError("KVzapThresholdCompaction: kernel launch failed");
    return status == 0 ? 0 : -1;
  }

  IPluginV3* attachToContext(IPluginResourceContext* /*context*/) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &mFields; }

 private:
  int32_t mSink;
  PluginField mField;
  PluginFieldCollection mFields{};
};

// The ONNX parser passes INT attributes as kINT32; accept the other integer field types as well.
bool readInteger(PluginField const& field, int64_t& value) {
  if (field.data == nullptr || field.length < 1) return false;
  switch (field.type) {
    case PluginFieldType::kINT8: value = *static_cast<int8_t const*>(field.data); return true;
    case PluginFieldType::kINT16: value = *static_cast<int16_t const*>(field.data); return true;
    case PluginFieldType::kINT32: value = *static_cast<int32_t const*>(field.data); return true;
    case PluginFieldType::kINT64: value = *static_cast<int64_t const*>(field.data); return true;
    default: return false;
  }
}

class KVzapPluginCreator final : public IPluginCreatorV3One {
 public:
  KVzapPluginCreator() {
    mAttribute = PluginField(kSinkField, nullptr, PluginFieldType::kINT32, 1);
    mFieldNames.nbFields = 1;
    mFieldNames.fields = &mAttribute;
  }
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldNames; }

  IPluginV3* createPlugin(AsciiChar const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept override {
    int64_t sink = 0;  // absent field: kvpress semantics
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      PluginField const& field = fc->fields[i];
      if (field.name == nullptr || std::strcmp(field.name, kSinkField) != 0) continue;
      if (!readInteger(field, sink)) {
        logError("KVzapThresholdCompaction: field 'sink' must be one integer");
        return nullptr;
      }
    }
    if (sink < 0 || sink > std::numeric_limits<int32_t>::max()) {
      logError("KVzapThresholdCompaction: field 'sink' must be in [0, 2^31)");
      return nullptr;
    }
    return new (std::nothrow) KVzapPlugin(static_cast<int32_t>(sink));
  }

 private:
  PluginField mAttribute;
  PluginFieldCollection mFieldNames{};
};

KVzapPluginCreator gCreator;

#if defined(KVZAP_STATIC_REGISTRATION)
struct StaticRegistration {
  StaticRegistration() { getPluginRegistry()->registerCreator(gCreator, kNamespace); }
};
StaticRegistration gStaticRegistration;
#else
IPluginCreatorInterface* gCreators[] = {&gCreator};
#endif

}  // namespace

#if !defined(KVZAP_STATIC_REGISTRATION)
// Entry points of a TensorRT plugin shared library (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins).
KVZAP_EXPORT void setLoggerFinder(ILoggerFinder* finder) { gLoggerFinder = finder; }

KVZAP_EXPORT IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  nbCreators = 1;
  return gCreators;
}
#endif
