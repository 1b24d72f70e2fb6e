// rejects: conversion function from 'const SharedBuffer' to 'TensorRef' invokes a deleted function
// A state dict entry made from a const owner would let a load write through it: TensorRef::read_only
// says that it is for saving.
import shardckpt;
using namespace shardckpt;

TensorRef f(const SharedBuffer& b) { return b; }
