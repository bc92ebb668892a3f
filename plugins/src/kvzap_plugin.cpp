// TensorRT IPluginV3 plugin "KVzapThresholdCompaction" (namespace "kvzap", version "1"): the op of the bundle's
// threshold_compaction_plugin.onnx node, enqueuing the CUDA kernels of libkvzap_kernels (include/kvzap/compaction.h).
// Written against TensorRT 10.x / 11.x NvInferRuntime.h. Never compiled on the machines of this project (no TensorRT
// headers there); CMake builds it where TensorRT is found. Load with trtexec --dynamicPlugins=libkvzap_trt_plugin.so
// or trt.get_plugin_registry().load_library(...).
#include "kvzap/compaction.h"

#include <NvInferRuntime.h>

#include <cstring>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

constexpr char const* kName = "KVzapThresholdCompaction";
constexpr char const* kVersion = "1";
constexpr char const* kNamespace = "kvzap";

class KVzapPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime {
 public:
  explicit KVzapPlugin(int32_t sink) : mSink(sink) { mField = PluginField("sink", &mSink, PluginFieldType::kINT32, 1); }

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override { return new KVzapPlugin(mSink); }

  // IPluginV3OneCore
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 3; }
  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbOutputs != 3 || nbInputs != 4) return -1;
    outputTypes[0] = DataType::kBOOL;   // keep
    outputTypes[1] = DataType::kINT32;  // counts
    outputTypes[2] = DataType::kINT32;  // indices
    return 0;
  }
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (nbInputs != 4 || nbOutputs != 3 || inputs[0].nbDims != 3) return -1;
    outputs[0] = inputs[0];
    outputs[2] = inputs[0];
    outputs[1].nbDims = 2;
    outputs[1].d[0] = inputs[0].d[0];
    outputs[1].d[1] = inputs[0].d[1];
    return 0;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != 4 || nbOutputs != 3) return false;
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR) return false;
    switch (pos) {
      case 0: return desc.type == DataType::kFLOAT || desc.type == DataType::kHALF || desc.type == DataType::kBF16;
      case 2: return desc.type == DataType::kFLOAT;  // threshold
      case 4: return desc.type == DataType::kBOOL;   // keep
      default: return desc.type == DataType::kINT32;  // lengths, window, counts, indices
    }
  }
  int32_t configurePlugin(DynamicPluginTensorDesc const* /*in*/, int32_t /*nbInputs*/, DynamicPluginTensorDesc const* /*out*/,
                          int32_t /*nbOutputs*/) noexcept override {
    return 0;
  }
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                          DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept override {
    return 0;
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* /*in*/, int32_t /*nbInputs*/, PluginTensorDesc const* /*out*/,
                        int32_t /*nbOutputs*/) noexcept override {
    return 0;
  }
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/, void const* const* inputs,
                  void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept override {
    Dims const& d = inputDesc[0].dims;
    int dtype = KVZAP_FLOAT32;
    if (inputDesc[0].type == DataType::kHALF) dtype = KVZAP_FLOAT16;
    if (inputDesc[0].type == DataType::kBF16) dtype = KVZAP_BFLOAT16;
    int const status = kvzap_threshold_compaction(
        inputs[0], dtype, static_cast<int32_t const*>(inputs[1]), static_cast<float const*>(inputs[2]),
        static_cast<int32_t const*>(inputs[3]), static_cast<int>(d.d[0]), static_cast<int>(d.d[1]),
        static_cast<int>(d.d[2]), mSink, static_cast<uint8_t*>(outputs[0]), static_cast<int32_t*>(outputs[1]),
        static_cast<int32_t*>(outputs[2]), stream);
    return status == 0 ? 0 : -1;
  }
  IPluginV3* attachToContext(IPluginResourceContext* /*context*/) noexcept override { return clone(); }
  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    mFields.nbFields = 1;
    mFields.fields = &mField;
    return &mFields;
  }

 private:
  int32_t mSink;
  PluginField mField;
  PluginFieldCollection mFields{};
};

class KVzapPluginCreator : public IPluginCreatorV3One {
 public:
  KVzapPluginCreator() {
    mAttributes.emplace_back(PluginField("sink", nullptr, PluginFieldType::kINT32, 1));
    mFieldNames.nbFields = static_cast<int32_t>(mAttributes.size());
    mFieldNames.fields = mAttributes.data();
  }
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldNames; }
  IPluginV3* createPlugin(AsciiChar const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept override {
    int32_t sink = 0;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      if (std::strcmp(fc->fields[i].name, "sink") == 0 && fc->fields[i].data != nullptr) {
        // The ONNX parser passes INT attributes as int32.
        sink = *static_cast<int32_t const*>(fc->fields[i].data);
      }
    }
    if (sink < 0) return nullptr;
    return new KVzapPlugin(sink);
  }

 private:
  std::vector<PluginField> mAttributes;
  PluginFieldCollection mFieldNames{};
};

KVzapPluginCreator gCreator;
IPluginCreatorInterface* gCreators[] = {&gCreator};

}  // namespace

// Dynamic loading (trtexec --dynamicPlugins, IPluginRegistry::loadLibrary) looks these up.
extern "C" {
void setLoggerFinder(nvinfer1::ILoggerFinder* /*finder*/) {}
IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  nbCreators = 1;
  return gCreators;
}
}
