// Streams one completion from a reflow gateway, given only protos/, then rates it.
// Usage: node stream.js HOST:PORT API_KEY PROMPT
// Prints one JSON object per received message, then {"ack": ...} of the rating and
// {"status": "OK"}, or the error.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [target, apiKey, prompt] = process.argv.slice(2);
const protoRoot = path.resolve(__dirname, "../../../protos");
const definition = protoLoader.loadSync("reflow/v1/inference.proto", {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
});
const reflow = grpc.loadPackageDefinition(definition).reflow.v1;
const client = new reflow.Inference(target, grpc.credentials.createInsecure());

const metadata = new grpc.Metadata();
metadata.add("authorization", `Bearer ${apiKey}`);
function fail(error) {
  console.log(JSON.stringify({ status: grpc.status[error.code], details: error.details }));
  process.exit(1);
}

let requestId = "";
const call = client.Generate({ prompt, sampling: { max_tokens: 12 } }, metadata);
call.on("data", (message) => {
  requestId = requestId || message.request_id;
  console.log(JSON.stringify(message));
});
call.on("error", fail);
call.on("end", () => {
  // SubmitFeedback is a client stream: write any number of items, then end it.
  const feedback = client.SubmitFeedback(metadata, (error, ack) => {
    if (error) fail(error);
    console.log(JSON.stringify({ ack }));
    console.log(JSON.stringify({ status: "OK" }));
  });
  feedback.write({ request_id: requestId, rating: -1, correction: "85" });
  feedback.end();
});
